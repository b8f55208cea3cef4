"""Every command and example in README.md is run or checked here: the fenced bash blocks' `make` targets exist and do
what the README says, its request is sent to a real server and the answer compared with the one shown, the
`fusedserve` command takes the options shown and `fusedserve embed` prints the line shown, each `docker build` names
a Dockerfile in deploy/ and each `docker run` an image one of them builds, the API table lists exactly the app's
routes, the settings rows exist with the defaults shown (both of a default that follows the device), the model row
names every preset, the Models section's mpnet directory is where the tests assemble it, what it says of config
files, metric names, the body limit and a wrong method holds on a real server, and every link resolves. A command
this file does not know how to check fails the test: a new kind of README command needs a check here.

The docs pages a newcomer reads next are held to what can be checked the same way: every curl that sends JSON says
so (and the admin one runs), docs/operations.md's reranker and SPLADE recipe runs and its directories load,
docs/development.md names only paths the repository has or builds, and docs/performance.md stays short, names no
machine's folders, and shows the numbers `python -m bench report` renders from the committed results."""

from __future__ import annotations

import importlib.metadata
import importlib.util
import json
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import httpx
import pytest
import yaml
from pydantic import ValidationError

from fusedserve.model import api
from fusedserve.server import config_doc
from fusedserve.server.config import Settings
from tests.server.conftest import ADMIN_TOKEN, free_port, start_server

ROOT = Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text()
DOCS = ROOT / "docs"
README_HOST = "localhost:8000"
MAX_LINES = 150


def section(title: str) -> str:
    """The text under `## title`, up to the next `## ` heading."""
    match = re.search(rf"^## {re.escape(title)}\n(.*?)(?=^## |\Z)", README, flags=re.MULTILINE | re.DOTALL)
    assert match, f"README has no '## {title}' section"
    return match.group(1)


def commands(text: str = README) -> list[tuple[str, list[str]]]:
    """(command, the comment lines right after it) for every command in the bash blocks of `text` (the README's),
    with backslash continuations joined."""
    out: list[tuple[str, list[str]]] = []
    for block in re.findall(r"^```bash\n(.*?)^```", text, flags=re.MULTILINE | re.DOTALL):
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


KNOWN = (("make",), ("curl",), ("fusedserve", "serve"), ("fusedserve", "embed"), ("docker", "build"),
         ("docker", "run"))


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


# ---- the fusedserve command -------------------------------------------------------------------------------------
def fusedserve(*args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    """The `fusedserve` script the install put beside this Python (what `make run` runs from .venv/bin)."""
    script = Path(sys.executable).parent / "fusedserve"
    assert script.is_file(), f"the install made no `fusedserve` command beside {sys.executable}"
    return subprocess.run([str(script), *args], capture_output=True, text=True, timeout=timeout, cwd=ROOT)


def test_the_fusedserve_commands_take_the_options_the_readme_gives():
    shown = of_kind("fusedserve", "serve") + of_kind("fusedserve", "embed")
    assert {words[1] for words, _ in shown} == {"serve", "embed"}, "README: show `fusedserve serve` and `embed`"
    for words, _ in shown:
        usage = fusedserve(words[1], "--help")
        assert usage.returncode == 0, usage.stderr
        options = [w.split("=")[0] for w in words[2:] if w.startswith("--")]
        unknown = [o for o in options if o not in usage.stdout]
        assert not unknown, f"`fusedserve {words[1]}` takes no {unknown} (README: {' '.join(words)})"


def test_fusedserve_embed_prints_the_line_the_readme_shows():
    ((words, comments),) = of_kind("fusedserve", "embed")
    texts = [w for w in words[2:] if not w.startswith("-")]
    result = fusedserve(*words[1:], timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    lines = result.stdout.splitlines()
    assert len(lines) == len(texts) == len(comments), f"one JSON line per text: {len(lines)} for {texts}"
    for line, comment in zip(lines, comments):
        matches(json.loads(line), expected_answer([comment]), "fusedserve embed")


def test_the_other_names_the_readme_gives_the_commands():
    """`python -m fusedserve`, the `fusedserve-embed` alias, and the earlier releases' commands, which stop with an
    error while the ones the README gives for them exist."""
    text = " ".join(section("The `fusedserve` command").split())
    assert "`python -m fusedserve` is the same command" in text
    scripts = {e.name: e.value for e in importlib.metadata.entry_points(group="console_scripts")
               if e.name.startswith("fusedserve")}
    assert scripts.get("fusedserve") == "fusedserve.cli:main", scripts
    assert "`fusedserve-embed` the older name of `fusedserve embed`" in text and "fusedserve-embed" in scripts
    alias = subprocess.run([str(Path(sys.executable).parent / "fusedserve-embed"), "--help"], capture_output=True,
                           text=True, timeout=120)
    assert alias.returncode == 0 and alias.stdout.startswith("usage: fusedserve embed"), alias.stdout + alias.stderr
    same = subprocess.run([sys.executable, "-m", "fusedserve", "embed", "--help"], capture_output=True, text=True,
                          timeout=120, cwd=ROOT)
    assert same.stdout == alias.stdout
    renamed = re.findall(r"`python -m ([\w.]+)` \((?:now )?`([^`]+)`\)", text)
    assert {old.split(".")[0] for old, _ in renamed} == {"server", "model", "kernels"}, renamed
    for old, new in renamed:
        module = old.replace(".X", ".cuda.build")  # X: any module of the package
        stopped = subprocess.run([sys.executable, "-m", module], capture_output=True, text=True, timeout=120,
                                 cwd=ROOT)
        # the bare `kernels` is Hugging Face's package (fusedserve.shadowing), which has no such module
        named = "fusedserve" in stopped.stderr or \
            old.startswith("kernels.") and f"No module named '{module.rsplit('.', 1)[0]}'" in stopped.stderr
        assert stopped.returncode != 0 and named, f"python -m {module}: {stopped.stderr}"
        if new.startswith("python -m "):
            assert importlib.util.find_spec(new.split()[-1].replace(".X", ".cuda.build")) is not None, new
        else:
            assert new.split()[1] in ("serve", "embed"), new


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
# settings whose default follows the device (Settings._check), as the README gives them: both values
DEVICE_DEFAULTS = {"max_batch_tokens": f"`{api.GPU_BATCH_TOKENS}` (GPU), `{api.CPU_BATCH_TOKENS}` (CPU)"}


def test_the_settings_rows_name_real_settings_with_their_defaults(monkeypatch):
    rows = re.findall(r"^\| `FUSEDSERVE_([A-Z_]+)` \| ([^|]+) \|", section("Settings"), flags=re.MULTILINE)
    assert rows, "README shows no settings"
    for name, default in rows:
        field = Settings.model_fields.get(name.lower())
        assert field is not None, f"README shows FUSEDSERVE_{name}, which is not a setting"
        expected = DEVICE_DEFAULTS.get(name.lower(), config_doc.default_text(field))
        assert default.strip() == expected, f"FUSEDSERVE_{name}: default {default.strip()}, not {expected}"
    assert set(DEVICE_DEFAULTS) <= {name.lower() for name, _ in rows}
    # the two defaults are the ones a server on each device takes
    monkeypatch.delenv("FUSEDSERVE_MAX_BATCH_TOKENS", raising=False)
    monkeypatch.delenv("FUSEDSERVE_CONFIG", raising=False)
    assert Settings(device="cuda").max_batch_tokens == api.GPU_BATCH_TOKENS
    assert Settings(device="cpu").max_batch_tokens == api.CPU_BATCH_TOKENS
    # and docs/operations.md's limits table gives both for the per-token answers that MAX_BATCH_TOKENS bounds
    limits = (DOCS / "operations.md").read_text()
    assert f"| {api.GPU_BATCH_TOKENS:,} on a GPU, {api.CPU_BATCH_TOKENS:,} on the CPU " in limits


def test_the_readme_lists_every_preset():
    from fusedserve.model.config import PRESETS

    (row,) = [line for line in section("Settings").splitlines() if line.startswith("| `FUSEDSERVE_MODEL` |")]
    presets = re.search(r"a preset \(([^)]*)\)", row)
    assert presets, "README's FUSEDSERVE_MODEL row lists no presets"
    listed = re.findall(r"`([^`]+)`", presets.group(1))
    assert sorted(listed) == sorted(PRESETS), f"README lists presets {listed}; fusedserve.model.config has {list(PRESETS)}"


def test_a_config_file_takes_the_names_the_readme_gives(tmp_path, monkeypatch):
    """The file's keys are the settings' names without the prefix; a prefixed key is refused; the environment wins."""
    for key in [k for k in os.environ if k.startswith("FUSEDSERVE_")]:
        monkeypatch.delenv(key)
    text = " ".join(section("Settings").split())
    (key, value, env_name, env_value), = re.findall(r"`(\w+): (\S+)` sets `FUSEDSERVE_(\w+)=(\S+)`", text)
    (refused,) = re.findall(r"`(fusedserve_\w+):`", text)
    assert key.upper() == env_name and value == env_value and refused == f"fusedserve_{key}"
    field_value = int(value)
    for name, body in ((f"{key}.yaml", f"{key}: {value}\n"), (f"{key}.toml", f"{key} = {value}\n")):
        (tmp_path / name).write_text(body)
        monkeypatch.setenv("FUSEDSERVE_CONFIG", str(tmp_path / name))
        assert getattr(Settings(), key) == field_value, name
    (tmp_path / "prefixed.yaml").write_text(f"{refused}: {value}\n")
    monkeypatch.setenv("FUSEDSERVE_CONFIG", str(tmp_path / "prefixed.yaml"))
    with pytest.raises(ValidationError, match=refused):
        Settings()
    assert "the environment wins" in text
    monkeypatch.setenv("FUSEDSERVE_CONFIG", str(tmp_path / f"{key}.yaml"))
    monkeypatch.setenv(f"FUSEDSERVE_{env_name}", str(field_value * 2))
    assert getattr(Settings(), key) == field_value * 2


def test_the_models_section_says_where_the_real_mpnet_lands(monkeypatch):
    """`make mpnet-parts` exists, and the directory the README names is where tests/support/mpnet.py assembles the
    model by default."""
    from tests.support import mpnet

    text = " ".join(section("Models").split())
    assert "`make mpnet-parts`" in text and "`.venv/bin/python -m tests.support.mpnet`" in text
    dry_run("mpnet-parts")
    (shown,) = re.findall(r"into `(~/[^`]+)`", text)
    for key in ("XDG_CACHE_HOME", mpnet.DIR_ENV):
        monkeypatch.delenv(key, raising=False)
    assert mpnet.target_dir() == Path(shown).expanduser()
    assert 'if __name__ == "__main__":\n    print(model_dir())' in (ROOT / "tests" / "support" / "mpnet.py").read_text()


def doc_section(page: str, heading: str) -> str:
    """The text under `heading` (a whole heading line, `### ...`) of a docs page, up to the next heading."""
    text = (ROOT / page).read_text()
    match = re.search(rf"^{re.escape(heading)}\n(.*?)(?=^#+ |\Z)", text, flags=re.MULTILINE | re.DOTALL)
    assert match, f"{page} has no {heading!r}"
    return match.group(1)


RECIPE = ("docs/operations.md", "### A reranker or SPLADE model to try")


@pytest.mark.slow
def test_the_reranker_and_splade_recipe_builds_directories_the_server_loads(tmp_path):
    """docs/operations.md's recipe, run as written on the packaged MiniLM (offline), its directories written under
    tmp_path; each loads as the kind its routes need, and its serving line names the directories it builds."""
    from fusedserve.model import load
    from fusedserve.model.weights import default_model_dir

    text = doc_section(*RECIPE)
    assert "untrained" in text and "trying the routes" in text
    (code,) = re.findall(r"^```python\n(.*?)^```", text, flags=re.MULTILINE | re.DOTALL)
    saved = re.findall(r'\.save\("([^"]+)"\)', code)
    assert len(saved) == 2, code
    code, swapped = re.subn(r"^base = .*$", f"base = {str(default_model_dir())!r}", code, flags=re.MULTILINE)
    assert swapped == 1, "the recipe sets `base` on a line of its own"
    code = code.replace('"/models/', '"models/')  # under tmp_path, the working directory
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "CUDA_VISIBLE_DEVICES": ""}
    result = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, env=env, capture_output=True, text=True,
                            timeout=600)
    assert result.returncode == 0, result.stderr[-4000:]
    reranker, splade = (tmp_path / path.lstrip("/") for path in saved)
    described = load(str(reranker), api.LoadOptions(device="cpu")).describe()
    assert (described.kind, len(described.labels)) == ("classifier", 1)
    assert load(str(splade), api.LoadOptions(device="cpu")).describe().kind == "sparse"
    (serve,) = [c for c, _ in commands(text) if "fusedserve serve" in c]
    models = Settings(models=re.search(r"FUSEDSERVE_MODELS=(\S+)", serve).group(1)).models
    assert set(saved) <= {spec.path for spec in models.values()}, serve


def api_row(route: str) -> str:
    (row,) = [line for line in section("API").splitlines() if line.startswith(f"| `{route}`")]
    return row


def test_the_metric_families_are_the_ones_the_readme_names(server):
    """`GET /metrics`: the service's families carry the prefix, and the others are exactly the ones the row names."""
    row = api_row("GET /metrics")
    assert "`fusedserve_`" in row
    others = set(re.findall(r"`(\w+_)\*`", row))
    families = set(re.findall(r"^# TYPE (\S+) ", httpx.get(server.url + "/metrics", timeout=30).text, re.MULTILINE))
    assert any(f.startswith("fusedserve_") for f in families)
    unnamed = sorted(f for f in families if not f.startswith(("fusedserve_", *others)))
    assert not unnamed, f"/metrics has families the README does not account for: {unnamed}"
    for prefix in others:
        assert any(f.startswith(prefix) for f in families), f"README names {prefix}* families; /metrics has none"


def test_the_body_limit_and_a_wrong_method_answer_as_the_readme_says(server):
    text = " ".join(README.split())
    (mib,) = re.findall(r"413 \(a body over `FUSEDSERVE_MAX_BODY_BYTES`, (\d+) MiB by default", text)
    limit = Settings.model_fields["max_body_bytes"].default
    assert int(mib) * 1024 * 1024 == limit
    over = b'{"inputs": "' + b"a" * limit + b'"}'
    r = httpx.post(server.url + "/infer", content=over, headers={"content-type": "application/json"}, timeout=60)
    assert r.status_code == 413, r.text
    assert "405 (a method the route does not take; `Allow` names the one it does)" in text
    r = httpx.get(server.url + "/infer", timeout=30)
    assert r.status_code == 405 and r.headers["allow"] == "POST" and "error" in r.json(), r.text


DOC_PAGES = ("README.md", "docs/operations.md", "docs/development.md", "docs/performance.md", "docs/kernels.md")


def test_every_link_resolves():
    """In the README and the docs pages this file checks; a link is relative to the page that holds it."""
    for page in DOC_PAGES:
        for target in re.findall(r"\]\(([^)\s]+)\)", (ROOT / page).read_text()):
            if re.match(r"[a-z]+://", target):
                continue
            path, _, anchor = target.partition("#")
            file = (ROOT / page).parent / path if path else ROOT / page
            assert file.exists(), f"{page} links to {path}, which does not exist"
            if anchor:
                headings = re.findall(r"^#+ (.+)$", file.read_text(), flags=re.MULTILINE)
                slugs = {re.sub(r"[^\w\- ]", "", h).strip().lower().replace(" ", "-") for h in headings}
                assert anchor in slugs, f"{page} links to {target}: no such heading in {path}"


# ---- the docs pages --------------------------------------------------------------------------------------------
def curls(text: str) -> list[str]:
    """Every curl command of a markdown page: in its bash blocks, and in its inline code."""
    inline = re.findall(r"`(curl [^`]+)`", re.sub(r"^```.*?^```", "", text, flags=re.MULTILINE | re.DOTALL))
    return [c for c, _ in commands(text) if c.startswith("curl ")] + inline


def sends_json(words: list[str]) -> bool:
    headers = [words[i + 1].lower().replace(" ", "") for i, w in enumerate(words[:-1]) if w in ("-H", "--header")]
    return "content-type:application/json" in headers


def test_every_curl_that_sends_json_says_so():
    """FastAPI reads a body sent without `content-type: application/json` as no JSON at all (a 422)."""
    pages = [ROOT / "README.md", *sorted(DOCS.rglob("*.md"))]
    found = {page.relative_to(ROOT).as_posix(): curls(page.read_text()) for page in pages}
    assert found["docs/operations.md"], "docs/operations.md shows no curl (the admin switch's)"
    unmarked = [f"{page}: {c}" for page, cs in found.items() for c in cs
                if {"-d", "--data", "--data-raw"} & set(shlex.split(c)) and not sends_json(shlex.split(c))]
    assert not unmarked, "curl commands that send JSON without its content-type:\n" + "\n".join(unmarked)
    assert not sends_json(shlex.split("curl -X POST -d '{}' http://h/admin/fused"))  # the check can fail


def test_the_admin_switch_curl_of_operations_md_works(server):
    """docs/operations.md's runtime switch, sent to a real server as written ($TOKEN, HOST: the server's)."""
    (command,) = [c for c in curls((DOCS / "operations.md").read_text()) if "/admin/fused" in c]
    words = [w.replace("$TOKEN", ADMIN_TOKEN) for w in shlex.split(command)]
    words = [w.replace("http://HOST:8000", README_HOST) for w in words]
    method, url, headers, data = as_request(words, server.url)
    try:
        response = httpx.request(method, url, headers=headers, content=data, timeout=60)
        assert response.status_code == 200, response.text
        assert response.json()["fused"] is json.loads(data)["enabled"]
    finally:
        httpx.post(server.url + "/admin/fused", json={"enabled": True}, timeout=60,
                   headers={"Authorization": f"Bearer {ADMIN_TOKEN}"})


# a module started by a top-level name other than fusedserve (`python -m server`, `python3 -m kernels.cuda.build`)
OLD_COMMAND = re.compile(r"python3? -m (server|model|kernels)\b")


def test_no_page_gives_an_old_command():
    found = [f"README.md: {c}" for c, _ in commands() if OLD_COMMAND.search(c)]
    for page in DOC_PAGES[1:]:
        found += [f"{page}: {m.group(0)}" for m in OLD_COMMAND.finditer((ROOT / page).read_text())]
    assert not found, "the commands are `fusedserve serve`, `fusedserve embed`, `python -m fusedserve.kernels.X`:\n" \
        + "\n".join(found)
    assert OLD_COMMAND.search("python -m server --port 1") and not OLD_COMMAND.search("python -m fusedserve serve")


def named_paths(text: str) -> set[str]:
    """The repository paths a page names in its code: words with a slash, less URLs, routes (a leading slash) and
    command-line values; a placeholder (`<op>`) cuts the path to the folder before it."""
    spans = re.findall(r"^```[a-z]*\n(.*?)^```", text, flags=re.MULTILINE | re.DOTALL)
    spans += re.findall(r"`([^`\n]+)`", re.sub(r"^```.*?^```", "", text, flags=re.MULTILINE | re.DOTALL))
    paths = set()
    for span in spans:
        for word in re.split(r"[\s=,;()\[\]\"']+", span):
            word = word.rstrip(".:")
            if "/" not in word or word.startswith(("/", "$", "-")) or re.match(r"[a-z]+://", word) or "|" in word:
                continue
            if "<" in word:
                word = word[:word.index("<")].rpartition("/")[0] + "/"
            paths.add(word)
    return paths


def ignored(path: str) -> bool:
    """A path git ignores: what a command here builds (.venv/, .whl/, .gpu-assets/), never committed."""
    return subprocess.run(["git", "check-ignore", "-q", "--no-index", path], cwd=ROOT).returncode == 0


def test_docs_development_names_only_paths_the_repository_has_or_builds():
    text = (DOCS / "development.md").read_text()
    paths = named_paths(text)
    assert {".ci/run", "bench/gpu.sh", "tests/server/test_docs_browser.py"} <= paths
    outside = sorted(p for p in paths if os.path.normpath(p).startswith(".."))
    assert not outside, f"docs/development.md names paths outside the repository: {outside}"
    missing = sorted(p for p in paths if not ((ROOT / p).exists() or ignored(p)))
    assert not missing, f"docs/development.md names paths the repository neither has nor builds: {missing}"
    assert named_paths("run `../shared/tools/x.sh` then `kernels/triton/<op>.py`") == \
        {"../shared/tools/x.sh", "kernels/triton/"}
    # what the browser test needs, where CI installs it
    assert "`chromium`" in text and "FUSEDSERVE_REQUIRE_BROWSER=1" in text
    assert "chromium" in (ROOT / ".ci" / "run").read_text()


PERFORMANCE_MAX_LINES = 330
# folders of a machine that ran something: no reader has them, and the numbers' provenance is the results file
MACHINE_PATH = re.compile(r"(?<![\w.])(?:~/|/(?:tmp|root|home|opt|work|usr|var|mnt|srv|scratch|data|Users)/)")


def test_docs_performance_is_short_and_names_no_machine_path():
    text = (DOCS / "performance.md").read_text()
    assert len(text.splitlines()) <= PERFORMANCE_MAX_LINES, f"docs/performance.md is over {PERFORMANCE_MAX_LINES} lines"
    found = [line for line in text.splitlines() if MACHINE_PATH.search(line)]
    assert not found, "docs/performance.md names machine paths:\n" + "\n".join(found)
    for sample in ("--model /work/main/.gpu-assets/minilm", "--log-dir /root/out", "--target /tmp/site", "~/.cache"):
        assert MACHINE_PATH.search(sample), sample
    for sample in ("`POST /v1/embeddings`", "`bench/results/h200/serve.json`", "`docs/img/kernels.png`"):
        assert not MACHINE_PATH.search(sample), sample


def markdown_tables(text: str) -> list[list[str]]:
    tables, current = [], []
    for line in text.splitlines() + [""]:
        if line.startswith("|"):
            current.append(line.strip())
        elif current:
            tables.append(current)
            current = []
    return tables


def test_docs_performance_shows_the_rows_the_report_renders():
    """A table of docs/performance.md whose header is one `python -m bench report` renders holds only rows it renders
    from the committed results: a stale or hand-edited number fails here."""
    from bench import report

    rendered = "\n".join(report.tables(path) for path in sorted((ROOT / "bench" / "results").rglob("*.json")))
    by_header: dict[str, set[str]] = {}
    for table in markdown_tables(rendered):
        by_header.setdefault(table[0], set()).update(table[2:])
    checked = 0
    for table in markdown_tables((DOCS / "performance.md").read_text()):
        if table[0] in by_header:
            stale = [row for row in table[2:] if row not in by_header[table[0]]]
            assert not stale, "docs/performance.md rows the committed results do not give:\n" + "\n".join(stale)
            checked += 1
    assert checked >= 8, f"only {checked} tables of docs/performance.md are the report's"
