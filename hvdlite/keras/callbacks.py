"""Horovod's Keras callbacks (`horovod.keras.callbacks`) for the backend Keras runs on."""
from . import BACKEND as _BACKEND

if _BACKEND == "tensorflow":
    from ..tensorflow.keras.callbacks import *  # noqa: F401,F403
    from ..tensorflow.keras.callbacks import __all__  # noqa: F401
elif _BACKEND == "jax":
    from ._jax_callbacks import *  # noqa: F401,F403
    from ._jax_callbacks import __all__  # noqa: F401
else:
    from ._torch_callbacks import *  # noqa: F401,F403
    from ._torch_callbacks import __all__  # noqa: F401
