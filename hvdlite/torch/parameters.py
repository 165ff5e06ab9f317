"""Parameter names and hooks that both distributed optimizers (optimizer.py, zero.py) use."""
from __future__ import annotations


def find_duplicates(lst) -> set:
    seen = set()
    dups = set()
    for el in lst:
        if el in seen:
            dups.add(el)
        seen.add(el)
    return dups


def remove_hooks(handles) -> None:
    """Remove gradient hooks (run by weakref.finalize once an optimizer is collected)."""
    for h in handles:
        h.remove()


def named_parameters(param_groups, named_parameters):
    """Validated (name, parameter) pairs sorted by name, and the prefix of their wire names.

    Wire names are Horovod's: "allreduce.<name>" for user-named parameters (Horovod's C++ side
    prefixed the op type); the default names already read "allreduce.noname.<g>.<i>".
    """
    if named_parameters is not None:
        named_parameters = list(named_parameters)
        wire_prefix = "allreduce."
    else:
        named_parameters = [(f"allreduce.noname.{i}.{j}", v)
                            for i, param_group in enumerate(param_groups)
                            for j, v in enumerate(param_group["params"])]
        wire_prefix = ""
    if any(not isinstance(p, tuple) for p in named_parameters):
        raise ValueError("named_parameters should be a sequence of tuples (name, parameter), "
                         "usually produced by model.named_parameters().")
    dups = find_duplicates([k for k, _ in named_parameters])
    if len(dups) > 0:
        raise ValueError("Parameter names in named_parameters must be unique. "
                         "Found duplicates: %s" % ", ".join(sorted(dups)))
    all_param_ids = {id(v) for param_group in param_groups for v in param_group["params"]}
    unnamed_param_ids = all_param_ids - {id(v) for _, v in named_parameters}
    if len(unnamed_param_ids):
        raise ValueError("named_parameters was specified, but one or more model parameters "
                         "were not named. Python object ids: "
                         "%s" % ", ".join(str(i) for i in unnamed_param_ids))
    return sorted(named_parameters, key=lambda kv: kv[0]), wire_prefix
