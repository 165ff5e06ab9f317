"""`hvdlite-run --check-build`: what this installation can use, in Horovod's table layout.

hvdlite has no compile step, so "built" means "importable here": a user can compare this table
with `horovodrun --check-build` from the machine they are migrating from.
"""
from __future__ import annotations

import importlib.util


def _importable(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):
        return False


def _torch_features() -> tuple[bool, bool]:
    """(gloo, nccl) as torch reports them; both False when torch cannot be imported."""
    try:
        import torch
        import torch.distributed as dist
    except Exception:
        return False, False
    gloo = dist.is_available() and dist.is_gloo_available()
    try:
        nccl = bool(torch.cuda.is_available() and dist.is_nccl_available())
    except Exception:
        nccl = False
    return bool(gloo), nccl


def check_build_text(version: str) -> str:
    """The table printed by --check-build."""
    gloo, nccl = _torch_features()
    mpi = _importable("mpi4py")

    def mark(ok: bool) -> str:
        return "X" if ok else " "

    return (
        f"hvdlite v{version}:\n"
        "\n"
        "Available Frameworks:\n"
        f"    [{mark(_importable('tensorflow'))}] TensorFlow\n"
        f"    [{mark(_importable('torch'))}] PyTorch\n"
        "\n"
        "Available Controllers:\n"
        f"    [{mark(mpi)}] MPI\n"
        f"    [{mark(gloo)}] Gloo\n"
        "\n"
        "Available Tensor Operations:\n"
        f"    [{mark(nccl)}] NCCL\n"
        f"    [{mark(mpi)}] MPI\n"
        f"    [{mark(gloo)}] Gloo\n"
    )
