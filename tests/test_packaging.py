"""The package as it ships and as it loads (docs/decisions/0015-one-namespace.md): the version is written once; a
release (`python -m build`: an sdist and the wheel built from it) holds the sources and that version; the wheel holds
one top-level name, `fusedserve`, with every file of the four folders and the kernels' package data; the release
wheel installed in a fresh environment beside the Hugging Face `kernels` package imports and serves; no module of
ours is loaded under two names in one process; and the container images copy what the install needs."""

from __future__ import annotations

import importlib.util
import json
import os
import re
import signal
import subprocess
import sys
import sysconfig
import tarfile
import time
import tomllib
import zipfile
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest
import yaml

from fusedserve import __version__
from tests.server.conftest import free_port
from tests.tolerances import assert_unit_length

ROOT = Path(__file__).resolve().parent.parent
# folder of the repository -> where its files are in the wheel
FOLDERS = {"fusedserve": "fusedserve", "kernels": "fusedserve/kernels", "model": "fusedserve/model",
           "server": "fusedserve/server"}
BARE_NAMES = ("kernels", "model", "server")
# The Hugging Face package whose import name is `kernels`. It installs without its dependencies, so the release is
# pinned to one whose `import kernels` needs only what the development environment has.
HF_KERNELS = "kernels==0.17.2"


def clean_env(**settings: str) -> dict[str, str]:
    """A process as a user starts it: none of this session's FUSEDSERVE_* settings, Python paths or Triton
    interpreter switch; `settings` added as FUSEDSERVE_<NAME>."""
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("FUSEDSERVE_", "PYTHON")) and k not in ("TRITON_INTERPRET", "VIRTUAL_ENV")}
    return env | {"PYTHONUNBUFFERED": "1"} | {f"FUSEDSERVE_{k.upper()}": v for k, v in settings.items()}


def run(command: list, timeout: float = 180, **kwargs) -> subprocess.CompletedProcess:
    result = subprocess.run([str(c) for c in command], capture_output=True, text=True, timeout=timeout, **kwargs)
    assert result.returncode == 0, f"{' '.join(map(str, command))} failed:\n{result.stdout}\n{result.stderr}"
    return result


def source_files() -> list[str]:
    """The repository's files as git sees them, committed or not (ignored build outputs left out)."""
    listed = run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"], cwd=ROOT).stdout
    return sorted(name for name in listed.split("\0") if name and (ROOT / name).is_file())


def copy_of_the_repository(work: Path) -> Path:
    """The repository's files under work/src: a build writes build/ and *.egg-info beside its sources."""
    for name in source_files():
        (work / "src" / name).parent.mkdir(parents=True, exist_ok=True)
        (work / "src" / name).write_bytes((ROOT / name).read_bytes())
    return work / "src"


def package_files() -> list[str]:
    """The files of the four folders, as the repository names them."""
    return [name for name in source_files() if name.split("/")[0] in FOLDERS]


# ---- the version ------------------------------------------------------------------------------------------------
def test_the_version_is_written_once():
    """fusedserve.__version__ is the version: pyproject.toml reads it, the server reports it (server/service.py
    imports it), and no other source file spells it out, so a release bumps one line."""
    pyproject = tomllib.loads((ROOT / "pyproject.toml").read_text())
    assert "version" not in pyproject["project"] and "version" in pyproject["project"]["dynamic"]
    assert pyproject["tool"]["setuptools"]["dynamic"]["version"] == {"attr": "fusedserve.__version__"}
    literal = re.compile(rf"""["']{re.escape(__version__)}["']""")
    spelled = [name for name in [*package_files(), "pyproject.toml"]
               if name != "fusedserve/__init__.py" and name.endswith((".py", ".toml"))
               and literal.search((ROOT / name).read_text())]
    assert spelled == [], f"the version written again outside fusedserve/__init__.py: {spelled}"


def test_the_changelog_has_a_section_for_the_version():
    """Releasing moves `## Unreleased` under the new version's heading and leaves an empty `## Unreleased` on top
    (docs/development.md, "Releasing"): a version bumped without its section fails here."""
    headings = re.findall(r"^## (.+)$", (ROOT / "CHANGELOG.md").read_text(), re.MULTILINE)
    assert headings[0] == "Unreleased", headings
    assert __version__ in headings[1:], f"CHANGELOG.md has no `## {__version__}` section: {headings}"
    assert len(set(headings)) == len(headings), f"a section heading twice: {headings}"


# ---- the release: `python -m build` -----------------------------------------------------------------------------
@dataclass
class Release:
    sdist: Path
    wheel: Path


@pytest.fixture(scope="module")
def release(tmp_path_factory) -> Release:
    """`python -m build` of a copy of the repository, as a release is made: the sdist, then the wheel built from the
    unpacked sdist, so a source the sdist leaves out is missing from the wheel too. Without isolation, so that the
    build needs no index: this environment's setuptools and `build` (the dev extra)."""
    work = tmp_path_factory.mktemp("release")
    source = copy_of_the_repository(work)
    run([sys.executable, "-m", "build", "--no-isolation", "--outdir", work / "dist", source])
    (sdist,) = (work / "dist").glob("fusedserve-*.tar.gz")
    (built,) = (work / "dist").glob("fusedserve-*.whl")
    return Release(sdist, built)


@pytest.mark.slow
def test_the_release_is_an_sdist_and_a_wheel_of_the_version(release):
    """Both carry fusedserve.__version__: in their names and in their metadata, as pyproject.toml's dynamic version
    reads it."""
    assert release.sdist.name == f"fusedserve-{__version__}.tar.gz"
    assert release.wheel.name == f"fusedserve-{__version__}-py3-none-any.whl"
    with zipfile.ZipFile(release.wheel) as archive:
        metadata = archive.read(f"fusedserve-{__version__}.dist-info/METADATA").decode()
    with tarfile.open(release.sdist) as archive:
        pkg_info = archive.extractfile(f"fusedserve-{__version__}/PKG-INFO").read().decode()
    for text in (metadata, pkg_info):
        assert re.search(rf"^Version: {re.escape(__version__)}$", text, re.MULTILINE), text[:400]


@pytest.mark.slow
def test_the_sdist_holds_the_package_sources(release):
    """Every file of the four folders (the CUDA sources, the tuning tables and the .proto among them), and what the
    build reads: pyproject.toml and the README it names."""
    with tarfile.open(release.sdist) as archive:
        shipped = {member.name.split("/", 1)[1] for member in archive.getmembers() if member.isfile()}
    expected = set(package_files()) | {"pyproject.toml", "README.md"}
    assert expected - shipped == set(), "files the sdist lacks"
    assert {name.split("/")[0] for name in shipped} >= set(FOLDERS)


@pytest.mark.slow
def test_the_release_wheel_holds_what_pip_builds(release, wheel):
    """The wheel the release builds from its sdist and the one `pip wheel` builds from the checkout hold the same
    files, so the checks of the wheel's contents below hold for the release's."""
    names = []
    for built in (release.wheel, wheel):
        with zipfile.ZipFile(built) as archive:
            names.append({n for n in archive.namelist() if n.startswith("fusedserve/")})
    assert names[0] == names[1], {"release only": names[0] - names[1], "pip only": names[1] - names[0]}


# ---- the wheel --------------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    """`pip wheel` of a copy of the repository, with build isolation as a user's `pip install .` and the images'
    builds have it (build-system.requires is enough)."""
    work = tmp_path_factory.mktemp("wheel")
    source = copy_of_the_repository(work)
    run([sys.executable, "-m", "pip", "wheel", "--no-deps", "-q", "-w", work / "dist", source])
    (built,) = (work / "dist").glob("fusedserve-*.whl")
    return built


@pytest.mark.slow
def test_the_wheels_only_top_level_name_is_fusedserve(wheel):
    with zipfile.ZipFile(wheel) as archive:
        names = archive.namelist()
        dist_info = next(n.split("/")[0] for n in names if n.endswith(".dist-info/WHEEL"))
        assert {n.split("/")[0] for n in names} == {"fusedserve", dist_info}
        assert archive.read(f"{dist_info}/top_level.txt").decode().split() == ["fusedserve"]
        scripts = archive.read(f"{dist_info}/entry_points.txt").decode()
    assert re.search(r"^fusedserve = fusedserve\.cli:main$", scripts, re.MULTILINE)
    assert re.search(r"^fusedserve-embed = fusedserve\.cli:embed_alias$", scripts, re.MULTILINE)


@pytest.mark.slow
def test_the_wheel_holds_every_file_of_the_four_folders(wheel):
    """A subpackage missing from pyproject's `packages` list, or a data file outside its package-data globs, would be
    missing here (the editable install of development finds them anyway)."""
    expected = {f"{FOLDERS[name.split('/')[0]]}/{name.split('/', 1)[1]}" for name in package_files()}
    with zipfile.ZipFile(wheel) as archive:
        shipped = {n for n in archive.namelist() if n.startswith("fusedserve/")}
    assert expected - shipped == set(), "files the wheel lacks"
    assert shipped - expected == set(), "files in the wheel that git does not know"
    assert any(re.fullmatch(r"fusedserve/kernels/cuda/csrc/\w+\.cu", n) for n in shipped)  # the CUDA sources
    assert any(re.fullmatch(r"fusedserve/kernels/tuning/[\w.-]+\.json", n) for n in shipped)  # the shipped tuning


# ---- installed beside the Hugging Face `kernels` ----------------------------------------------------------------
@dataclass
class Environment:
    root: Path  # a virtual environment holding the release's wheel and Hugging Face's `kernels`, without dependencies
    site_packages: Path

    def bin(self, name: str) -> Path:
        return self.root / "bin" / name


@pytest.fixture(scope="module")
def installed(release, tmp_path_factory) -> Environment:
    """The release's wheel, as a user installs it: the one environment the install tests share (each costs a venv)."""
    work = tmp_path_factory.mktemp("installed")
    run([sys.executable, "-m", "pip", "download", "--no-deps", "-q", "-d", work, HF_KERNELS])
    (hf_kernels,) = work.glob("kernels-*.whl")
    root = work / "venv"
    python = root / "bin" / "python"
    run([sys.executable, "-m", "venv", "--without-pip", root])
    # this environment's pip installs into the new one, which has none of its own
    run([sys.executable, "-m", "pip", "--python", python, "install", "--no-deps", "--no-index", "-q", release.wheel,
         hf_kernels])
    site_packages = Path(run([python, "-c", "import sysconfig; print(sysconfig.get_path('purelib'))"],
                             env=clean_env()).stdout.strip())
    # The dependencies (torch, fastapi, ...) are this environment's, on a path line of a .pth file: sys.path takes it
    # after the new environment's own site-packages, so `fusedserve` and `kernels` resolve to what was just installed,
    # and the .pth files in it are not run, so the editable install of the checkout stays out.
    development = dict.fromkeys(sysconfig.get_paths()[key] for key in ("purelib", "platlib"))
    (site_packages / "development-dependencies.pth").write_text("".join(f"{path}\n" for path in development))
    return Environment(root, site_packages)


IMPORTS = """
import json, fusedserve.kernels, kernels
print(json.dumps({"fusedserve.kernels": fusedserve.kernels.__file__, "select": hasattr(fusedserve.kernels, "select"),
                  "kernels": kernels.__file__, "version": kernels.__version__,
                  "get_kernel": hasattr(kernels, "get_kernel")}))
"""


@pytest.mark.slow
def test_it_imports_beside_hugging_faces_kernels(installed, tmp_path):
    found = json.loads(run([installed.bin("python"), "-c", IMPORTS], cwd=tmp_path, env=clean_env()).stdout)
    assert Path(found["fusedserve.kernels"]) == installed.site_packages / "fusedserve" / "kernels" / "__init__.py"
    assert found["select"]  # ours: kernels.select(...) picks the backends
    assert Path(found["kernels"]) == installed.site_packages / "kernels" / "__init__.py"
    assert found["version"] == HF_KERNELS.split("==")[1] and found["get_kernel"]  # theirs: kernels from the Hub


def ready(url: str) -> bool:
    try:
        return httpx.get(url + "/readyz", timeout=1).status_code == 200
    except httpx.HTTPError:  # the port is not open yet
        return False


@pytest.mark.slow
def test_the_release_wheel_serves_beside_hugging_faces_kernels(installed, tmp_path):
    port, log_path = free_port(), tmp_path / "server.log"
    env = clean_env(model="tiny", device="cpu", max_batch_tokens="512")
    with open(log_path, "w") as log:
        process = subprocess.Popen(
            [installed.bin("fusedserve"), "serve", "--port", str(port), "--log-level", "warning"],
            cwd=tmp_path, env=env, stdout=log, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 120
        while not ready(url):
            assert process.poll() is None and time.monotonic() < deadline, log_path.read_text()
            time.sleep(0.2)
        response = httpx.post(url + "/infer", json={"inputs": ["hello world", "fused kernels"]}, timeout=60)
        assert response.status_code == 200, response.text
        body = response.json()
        assert body["model"] == "tiny" and body["dim"] == 64 and len(body["embeddings"]) == 2
        assert_unit_length(body["embeddings"])
        assert httpx.get(url + "/v2", timeout=10).json()["version"] == __version__  # the installed server's own
    finally:
        if process.poll() is None:
            process.send_signal(signal.SIGTERM)
        process.wait(timeout=60)
    assert process.returncode in (0, -signal.SIGTERM), log_path.read_text()  # uvicorn re-raises the SIGTERM


# ---- one name per module ----------------------------------------------------------------------------------------
@pytest.mark.parametrize("name", BARE_NAMES)
def test_a_bare_name_is_never_ours(name):
    """From the repository's root, which is on sys.path here, `import kernels` finds the folder: it runs none of its
    own code and hands the import to the installed package of that name (Hugging Face's `kernels` in the development
    environment), or fails naming the one name it loads under (fusedserve.shadowing)."""
    result = subprocess.run([sys.executable, "-c", f"import {name}; print({name}.__file__)"], cwd=ROOT,
                            env=clean_env(), capture_output=True, text=True, timeout=60)
    if result.returncode == 0:
        assert not Path(result.stdout.strip()).resolve().is_relative_to(ROOT / name), result.stdout
    else:
        last = result.stderr.splitlines()[-1]
        assert last.startswith("ModuleNotFoundError") and f"fusedserve.{name}" in last, result.stderr


@pytest.mark.parametrize("command, message", [
    (["server"], r"fusedserve serve"),
    # no installed `kernels`: the refusal names ours; Hugging Face's installed: it has no such module
    (["kernels.cuda.build"], r"fusedserve\.kernels|No module named 'kernels\.cuda'"),
    (["model"], r"fusedserve\.model"),
])
def test_an_old_command_fails_naming_the_new_one(command, message):
    result = subprocess.run([sys.executable, "-m", *command], cwd=ROOT, env=clean_env(), capture_output=True,
                            text=True, timeout=60)
    assert result.returncode != 0
    assert re.search(message, result.stderr), result.stderr


ONE_NAME_EACH = """
import importlib, json, os, sys, time
from fastapi.testclient import TestClient
from fusedserve.server.app import create_app

root = os.path.realpath(sys.argv[1])
refused = {}
with TestClient(create_app()) as client:
    deadline = time.monotonic() + 120
    while client.get("/readyz").status_code != 200:
        assert time.monotonic() < deadline, "not ready in time"
        time.sleep(0.1)
    assert client.post("/infer", json={"inputs": ["hello"]}).status_code == 200
    for name in ("server.metrics", "model.runner", "kernels.registry"):  # a second copy of a running module
        try:
            importlib.import_module(name)
        except (ImportError, SystemExit) as exc:
            refused[name] = str(exc)
bare = {name: getattr(sys.modules.get(name), "__file__", None) for name in ("kernels", "model", "server")}
folders = tuple(os.path.join(root, folder) + os.sep for folder in ("fusedserve", "kernels", "model", "server"))
names = {}
for name, module in list(sys.modules.items()):
    path = getattr(module, "__file__", None)
    if path and os.path.realpath(path).startswith(folders):
        names.setdefault(os.path.realpath(path), []).append(name)
print(json.dumps({"refused": refused, "bare": bare, "names": names}))
"""


@pytest.mark.slow
def test_a_running_app_holds_each_module_under_one_name(tmp_path):
    """The app started from the repository's root (tiny model, CPU), where the bare names can be found: each of our
    source files is loaded once, as fusedserve.*, and asking for a second copy of a running module (server.metrics,
    whose metric families a second copy would define again) fails before any of its code runs: the bare name is
    refused naming ours, or is the installed package of that name, which has no such module."""
    result = run([sys.executable, "-c", ONE_NAME_EACH, ROOT], cwd=ROOT, timeout=180,
                 env=clean_env(model="tiny", device="cpu", max_batch_tokens="512"))
    found = json.loads(result.stdout.splitlines()[-1])
    assert set(found["refused"]) == {"server.metrics", "model.runner", "kernels.registry"}
    for name, message in found["refused"].items():
        top = name.split(".")[0]
        installed_instead = found["bare"][top] and not Path(found["bare"][top]).resolve().is_relative_to(ROOT / top)
        assert f"fusedserve.{top}" in message or installed_instead, (message, found["bare"])
    loaded = found["names"]
    assert str(ROOT / "server" / "metrics.py") in loaded and str(ROOT / "kernels" / "registry.py") in loaded
    twice = {path: names for path, names in loaded.items() if len(names) > 1}
    assert not twice, f"files loaded under more than one name: {twice}"
    assert all(names[0].startswith("fusedserve") for names in loaded.values())


def runnable_modules() -> dict[str, str]:
    """Our modules that run as `python -m NAME` (a __main__.py or a `__name__ == "__main__"` block) -> their package."""
    found = {}
    for folder, target in FOLDERS.items():
        for path in (ROOT / folder).rglob("*.py"):
            if path.name == "__main__.py" or 'if __name__ == "__main__":' in path.read_text():
                name = ".".join([*target.split("/"), *path.relative_to(ROOT / folder).with_suffix("").parts])
                found[name] = name.rpartition(".")[0]
    return found


@pytest.mark.slow
def test_no_package_imports_a_module_that_runs_as_main():
    """`python -m NAME` imports NAME's package first and then runs NAME's file as __main__: were NAME imported by
    then, the process would hold that file twice (runpy warns "found in sys.modules ... prior to execution")."""
    modules = runnable_modules()
    assert "fusedserve.kernels.cuda.build" in modules and "fusedserve.server.__main__" in modules
    script = (f"import importlib, json, sys\nfor package in {sorted(set(modules.values()))!r}: "
              f"importlib.import_module(package)\n"
              f"print(json.dumps(sorted(set({sorted(modules)!r}) & set(sys.modules))))")
    imported = json.loads(run([sys.executable, "-c", script], cwd=ROOT, env=clean_env()).stdout)
    assert imported == [], f"imported by their packages before running as __main__: {imported}"


def test_transformers_does_not_mistake_our_kernels_package():
    """In this process (pytest puts the repository's root on sys.path) transformers' probe for the Hugging Face
    `kernels` package can find our kernels/ folder by its bare name; importing it hands over to the installed package
    (fusedserve.shadowing), so `kernels` is never ours here. Since transformers 5.25 Hugging Face's `kernels` is one
    of its dependencies: the probe may find that one, installed."""
    from transformers.utils import import_utils

    import_utils.is_kernels_available.cache_clear()  # asked again here, not under another test's conditions
    import_utils.is_kernels_available()
    try:
        bare = importlib.import_module("kernels")
    except ModuleNotFoundError as exc:  # none installed: the refusal names ours
        assert "fusedserve.kernels" in str(exc)
    else:
        assert not Path(bare.__file__).resolve().is_relative_to(ROOT / "kernels"), bare.__file__
    # a bare name loaded from our folder (the virtual environment may sit under the root too: the folder decides)
    ours = [name for name, module in list(sys.modules.items()) if name.split(".")[0] in BARE_NAMES
            and Path(getattr(module, "__file__", None) or "/").resolve().is_relative_to(ROOT / name.split(".")[0])]
    assert not ours, ours


# ---- the container images ---------------------------------------------------------------------------------------
DOCKERFILES = sorted((ROOT / "deploy" / "docker").glob("Dockerfile.*"))


def instruction(text: str, name: str) -> list[str]:
    """The exec form (a JSON list) of a Dockerfile instruction."""
    return json.loads(re.search(rf"^{name} (\[.*\])$", text, re.MULTILINE).group(1))


@pytest.mark.parametrize("dockerfile", DOCKERFILES, ids=lambda p: p.name)
def test_an_image_copies_every_folder_the_install_maps_and_the_context_keeps_them(dockerfile):
    """`pip install .` in the image builds the package-dir mapping, so each mapped folder must be copied in; the
    build context (.dockerignore: everything excluded, then what the images need) must keep what is copied."""
    copied = {source for line in re.findall(r"^COPY (?!--)(.+)$", dockerfile.read_text(), re.MULTILINE)
              for source in line.split()[:-1]}
    assert set(FOLDERS) | {"pyproject.toml", "README.md"} <= copied
    ignore = [line.strip() for line in (ROOT / ".dockerignore").read_text().splitlines()
              if line.strip() and not line.startswith("#")]
    assert ignore[0] == "*", ".dockerignore is expected to exclude everything, then name what the images need"
    kept = {line[1:].rstrip("/") for line in ignore if line.startswith("!")}
    assert copied <= kept, f".dockerignore leaves out {sorted(copied - kept)}"


@pytest.mark.parametrize("dockerfile", DOCKERFILES, ids=lambda p: p.name)
def test_an_image_runs_the_command_with_the_arguments_it_is_given(dockerfile):
    """The image's ENTRYPOINT, with its CMD or with the Kubernetes container's args (which replace CMD), is a command
    line the `fusedserve` command accepts (the server's parser reads it all before --help stops it)."""
    text = dockerfile.read_text()
    entrypoint = instruction(text, "ENTRYPOINT")
    assert entrypoint[:2] == ["fusedserve", "serve"]  # the console script, on the image's PATH
    deployment = yaml.safe_load((ROOT / "deploy" / "k8s" / "base" / "deployment.yaml").read_text())
    (container,) = deployment["spec"]["template"]["spec"]["containers"]
    for args in (instruction(text, "CMD"), container["args"]):
        result = run([Path(sys.executable).parent / entrypoint[0], *entrypoint[1:], *args, "--help"], timeout=60)
        assert result.stdout.startswith("usage: fusedserve serve ")
