"""Every command and example in README.md is run or checked here: the fenced bash blocks' `make` targets exist
and do what the README says, its request is sent to a real server and the answer compared with the one shown,
each `docker build` names a Dockerfile in deploy/ and each `docker run` an image one of them builds, the API table
lists exactly the app's routes, the settings rows exist with the defaults shown, and every link resolves.
A command this file does not know how to check fails the test: a new kind of README command needs a check here."""

from __future__ import annotations

import json
import os
import re
import shlex
import subprocess
from pathlib import Path

import httpx
import pytest
import yaml

from fusedserve.server import config_doc
from fusedserve.server.config import Settings
from tests.server.conftest import free_port, start_server

ROOT = Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text()
README_HOST = "localhost:8000"
MAX_LINES = 150


def section(title: str) -> str:
    """The text under `## title`, up to the next `## ` heading."""
    match = re.search(rf"^## {re.escape(title)}\n(.*?)(?=^## |\Z)", README, flags=re.MULTILINE | re.DOTALL)
    assert match, f"README has no '## {title}' section"
    return match.group(1)


def commands() -> list[tuple[str, list[str]]]:
    """(command, the comment lines right after it) for every command in the README's bash blocks, with
    backslash continuations joined."""
    out: list[tuple[str, list[str]]] = []
    for block in re.findall(r"^```bash\n(.*?)^```", README, flags=re.MULTILINE | re.DOTALL):
        lines = block.replace("\\\n", " ").splitlines()
        for line in lines:
            if line.startswith("#"):
                if out:
                    out[-1][1].append(line[1:].strip())
            elif line.strip():
                out.append((re.sub(r"\s+#.*$", "", line).strip(), []))
    return out


def of_kind(*prefix: str) -> list[tuple[list[str], list[str]]]:
    found = []
    for command, comments in commands():
        words = shlex.split(command)
        if tuple(words[: len(prefix)]) == prefix:
            found.append((words, comments))
    return found


KNOWN = (("make",), ("curl",), ("docker", "build"), ("docker", "run"))


def test_the_readme_is_short_and_every_command_in_it_is_checked_here():
    assert len(README.splitlines()) <= MAX_LINES, f"README.md is over {MAX_LINES} lines"
    unchecked = [c for c, _ in commands() if not any(tuple(shlex.split(c)[: len(k)]) == k for k in KNOWN)]
    assert not unchecked, f"README commands tests/test_readme.py does not check: {unchecked}"
    assert {"make run", "make test"} <= {c for c, _ in commands()}, "the two commands must stay in the README"


# ---- make ------------------------------------------------------------------------------------------------------
def dry_run(*args: str) -> str:
    result = subprocess.run(["make", "-n", *args], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, f"make -n {' '.join(args)} failed:\n{result.stderr}"
    return result.stdout


def test_the_make_commands_exist_and_do_what_the_readme_says():
    for words, _ in of_kind("make"):
        dry_run(*words[1:])
    port = free_port()
    assert re.search(rf"fusedserve serve --host 127\.0\.0\.1 --port {port}$", dry_run("run", f"PORT={port}"), re.MULTILINE)
    assert re.search(r"fusedserve serve --host 0\.0\.0\.0 --port 9000$", dry_run("run", "HOST=0.0.0.0", "PORT=9000"),
                     re.MULTILINE), "README: `make run HOST=... PORT=...` changes the address"
    assert re.search(r"-m pytest\b", dry_run("test"))


# ---- the request ---------------------------------------------------------------------------------------------
PLACEHOLDER = re.compile(r"<(\d+) floats>")


def expected_answer(comments: list[str]) -> dict:
    """The answer the README shows after a request: JSON in which `<N floats>` stands for a row of N numbers."""
    assert comments, "a README request must show its answer on the comment line after it"
    return json.loads(PLACEHOLDER.sub(r'{"floats": \1}', comments[0]))


def matches(actual, expected, where: str = "answer") -> None:
    if isinstance(expected, dict) and set(expected) == {"floats"}:
        assert isinstance(actual, list) and len(actual) == expected["floats"], f"{where}: {len(actual)} floats"
        assert all(isinstance(v, float) for v in actual), where
    elif isinstance(expected, dict):
        assert isinstance(actual, dict) and set(actual) == set(expected), f"{where}: keys {set(actual)}"
        for key in expected:
            matches(actual[key], expected[key], f"{where}.{key}")
    elif isinstance(expected, list):
        assert isinstance(actual, list) and len(actual) == len(expected), f"{where}: {len(actual)} items"
        for i, (a, e) in enumerate(zip(actual, expected)):
            matches(a, e, f"{where}[{i}]")
    else:
        assert actual == expected, f"{where}: {actual!r}, the README says {expected!r}"


def as_request(words: list[str], base_url: str) -> tuple[str, str, dict[str, str], str | None]:
    method, url, headers, data = None, None, {}, None
    args = iter(words[1:])
    for word in args:
        if word in ("-H", "--header"):
            key, _, value = next(args).partition(":")
            headers[key.strip()] = value.strip()
        elif word in ("-d", "--data", "--data-raw"):
            data = next(args)
        elif word in ("-X", "--request"):
            method = next(args)
        elif word in ("-s", "--silent", "-S", "--show-error", "-f", "--fail"):
            continue
        else:
            assert url is None and not word.startswith("-"), f"README curl: unexpected {word!r}"
            url = word
    assert url and url.startswith(README_HOST), f"README curl should address {README_HOST} (what make run serves)"
    return method or ("POST" if data is not None else "GET"), base_url + url[len(README_HOST):], headers, data


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    """The server `make run` starts (fusedserve serve, the default settings: the packaged MiniLM on the CPU)."""
    srv = start_server(tmp_path_factory.mktemp("readme"))
    yield srv
    srv.stop()


def test_every_request_in_the_readme_gets_the_answer_it_shows(server):
    requests = of_kind("curl")
    assert requests, "the README shows no request"
    for words, comments in requests:
        method, url, headers, data = as_request(words, server.url)
        response = httpx.request(method, url, headers=headers, content=data, timeout=60)
        assert response.status_code == 200, response.text
        matches(response.json(), expected_answer(comments))


# ---- containers ------------------------------------------------------------------------------------------------
def built_images() -> dict[str, Path]:
    """image name -> the Dockerfile in deploy/ that builds it (the compose file names each image and its file)."""
    compose_file = ROOT / "deploy/compose/docker-compose.yml"
    compose = yaml.safe_load(compose_file.read_text())
    images = {}
    for service in compose["services"].values():
        build = service.get("build")
        if isinstance(build, dict) and "image" in service:
            dockerfile = (compose_file.parent / build.get("context", ".") / build.get("dockerfile", "Dockerfile"))
            images[service["image"]] = dockerfile.resolve()
    assert images, "the compose file builds no image"
    return images


# `docker run` options that take a value (the rest are flags)
RUN_VALUE_OPTIONS = {"-p", "--publish", "-v", "--volume", "-e", "--env", "--env-file", "--tmpfs", "--gpus", "--name",
                     "--network", "-u", "--user", "--mount", "-w", "--workdir", "--entrypoint", "--cpus", "-m",
                     "--memory", "--restart", "--shm-size"}


def run_image(words: list[str]) -> str:
    args = iter(words[2:])
    for word in args:
        if word in RUN_VALUE_OPTIONS:
            next(args)
        elif not word.startswith("-"):
            return word
    raise AssertionError(f"no image in {' '.join(words)}")


def test_every_docker_line_names_an_image_a_dockerfile_in_deploy_builds():
    images = built_images()
    for dockerfile in images.values():
        assert dockerfile.is_file() and ROOT / "deploy" in dockerfile.parents, dockerfile
    for words, _ in of_kind("docker", "build"):
        file = Path(words[words.index("-f") + 1])
        tag = words[words.index("-t") + 1]
        assert words[-1] == ".", "README: docker build runs from the repository root (context .)"
        assert images.get(tag) == (ROOT / file).resolve(), f"{tag} is not the image {file} builds (compose file)"
    ran = [run_image(words) for words, _ in of_kind("docker", "run")]
    assert all(image in images for image in ran), f"README runs images no Dockerfile in deploy/ builds: {ran}"
    missing = sorted(set(images) - set(ran))
    assert not missing, f"README has no docker run line for {missing}"
    # every Dockerfile in deploy/ builds one of those images
    assert set(images.values()) == {p.resolve() for p in (ROOT / "deploy").rglob("Dockerfile*")}


# ---- the API table ---------------------------------------------------------------------------------------------
def app_routes() -> set[tuple[str, str]]:
    """(method, path) of every documented route of the app (FastAPI's own /docs and /openapi.json left out)."""
    from fusedserve.server.app import create_app

    found: set[tuple[str, str]] = set()

    def walk(routes, prefix: str = "") -> None:
        for route in routes:
            included = getattr(route, "original_router", None)  # FastAPI's included router, on newer releases
            if included is not None:
                walk(included.routes, prefix + (getattr(route.include_context, "prefix", "") or ""))
            elif getattr(route, "include_in_schema", False) and getattr(route, "methods", None):
                found.update((method, prefix + route.path) for method in route.methods - {"HEAD"})

    walk(create_app(Settings()).routes)
    return found


def test_the_api_table_lists_exactly_the_apps_routes(monkeypatch):
    for key in [k for k in os.environ if k.startswith("FUSEDSERVE_")]:
        monkeypatch.delenv(key)
    table = "\n".join(line for line in section("API").splitlines() if line.startswith("| `"))
    listed = set(re.findall(r"`(GET|POST|PUT|DELETE|PATCH) (/[^`\s]*)`", table))
    routes = app_routes()
    assert listed - routes == set(), f"README lists routes the app does not have: {sorted(listed - routes)}"
    assert routes - listed == set(), f"routes missing from the README's API table: {sorted(routes - listed)}"


# ---- settings and links ----------------------------------------------------------------------------------------
def test_the_settings_rows_name_real_settings_with_their_defaults():
    rows = re.findall(r"^\| `FUSEDSERVE_([A-Z_]+)` \| ([^|]+) \|", section("Settings"), flags=re.MULTILINE)
    assert rows, "README shows no settings"
    for name, default in rows:
        field = Settings.model_fields.get(name.lower())
        assert field is not None, f"README shows FUSEDSERVE_{name}, which is not a setting"
        assert default.strip() == config_doc.default_text(field), f"FUSEDSERVE_{name}: default {default.strip()}"


def test_every_link_resolves():
    for target in re.findall(r"\]\(([^)\s]+)\)", README):
        if re.match(r"[a-z]+://", target):
            continue
        path, _, anchor = target.partition("#")
        file = ROOT / path
        assert file.exists(), f"README links to {path}, which does not exist"
        if anchor:
            headings = re.findall(r"^#+ (.+)$", file.read_text(), flags=re.MULTILINE)
            slugs = {re.sub(r"[^\w\- ]", "", h).strip().lower().replace(" ", "-") for h in headings}
            assert anchor in slugs, f"README links to {target}: no such heading in {path}"
