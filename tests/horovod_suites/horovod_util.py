"""What Horovod's own test files import from `horovod.common.util` (Horovod 0.28), for the
suites in this folder: their `from horovod.common.util import ...` lines are rewritten to this
module, as their `import horovod.<framework>` lines are to hvdlite."""
from packaging import version


def is_version_greater_equal_than(ver, min_ver):
    return version.parse(ver) >= version.parse(min_ver)
