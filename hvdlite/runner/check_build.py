"""`hvdlite-run --check-build`: what this installation can use, in Horovod's table layout.

hvdlite has no compile step, so "built" means "importable here": a user can compare this table
with `horovodrun --check-build` from the machine they are migrating from. The launcher never
imports torch or TensorFlow itself (that would cost seconds and load CUDA): versions come from the
installed packages' metadata, and what torch's build offers (gloo, NCCL) from one short subprocess.
"""
from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from importlib import metadata
from typing import Optional

_PROBE = """
import json
import torch, torch.distributed as dist
out = {"gloo": bool(dist.is_available() and dist.is_gloo_available()), "nccl": False,
       "nccl_version": None}
try:
    out["nccl"] = bool(torch.cuda.is_available() and dist.is_nccl_available())
    if dist.is_nccl_available():
        v = torch.cuda.nccl.version()
        out["nccl_version"] = ".".join(map(str, v)) if isinstance(v, tuple) else str(v)
except Exception:
    pass
print(json.dumps(out))
"""


def _importable(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):
        return False


def _version(*dists: str) -> Optional[str]:
    """`name version` of the first installed distribution among `dists`."""
    for dist in dists:
        try:
            return f"{dist} {metadata.version(dist)}"
        except metadata.PackageNotFoundError:
            continue
    return None


def _torch_features() -> dict:
    """gloo/NCCL as torch's build reports them, asked in a subprocess; all False without torch."""
    if not _importable("torch"):
        return {"gloo": False, "nccl": False, "nccl_version": None}
    try:
        done = subprocess.run([sys.executable, "-c", _PROBE], capture_output=True, text=True,
                              timeout=120)
        return json.loads(done.stdout.strip().splitlines()[-1])
    except (OSError, subprocess.SubprocessError, ValueError, IndexError):
        return {"gloo": False, "nccl": False, "nccl_version": None}


def versions(nccl_version: Optional[str] = None) -> list[tuple[str, str]]:
    """(component, what was found) for the frameworks, MPI and NCCL, from package metadata."""
    nccl = _version("nvidia-nccl-cu12", "nvidia-nccl-cu11", "nvidia-nccl-cu13")
    if nccl_version:
        nccl = f"{nccl_version} (torch's build)" + (f", {nccl}" if nccl else "")
    mpi4py = _version("mpi4py")
    library = _version("mpich", "openmpi", "impi-rt", "msmpi")
    mpi = None
    if mpi4py:
        mpi = mpi4py + (f" over {library}" if library else " over the system MPI library")
    return [
        ("PyTorch", _version("torch") or "not found"),
        ("TensorFlow", _version("tensorflow", "tensorflow-cpu", "tf-nightly",
                                "tensorflow-macos") or "not found"),
        ("Keras", _version("keras", "tf_keras", "tf-keras") or "not found"),
        ("MPI", mpi or "not found"),
        ("NCCL", nccl or "not found"),
    ]


def check_build_text(version: str) -> str:
    """The table printed by --check-build, then the versions found."""
    features = _torch_features()
    gloo, nccl = bool(features.get("gloo")), bool(features.get("nccl"))
    mpi = _importable("mpi4py")

    def mark(ok: bool) -> str:
        return "X" if ok else " "

    found = "".join(f"    {name + ':':<12}{text}\n"
                    for name, text in versions(features.get("nccl_version")))
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
        "\n"
        "Versions found:\n"
        f"{found}"
    )
