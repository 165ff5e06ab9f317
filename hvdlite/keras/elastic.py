"""Elastic Keras training (`horovod.keras.elastic`) for the backend Keras runs on."""
from . import BACKEND as _BACKEND

if _BACKEND == "tensorflow":
    from ..tensorflow.keras.elastic import *  # noqa: F401,F403
    from ..tensorflow.keras.elastic import __all__  # noqa: F401
elif _BACKEND == "jax":
    from ._jax_elastic import *  # noqa: F401,F403
    from ._jax_elastic import __all__  # noqa: F401
else:
    from ._torch_elastic import *  # noqa: F401,F403
    from ._torch_elastic import __all__  # noqa: F401
