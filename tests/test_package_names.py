"""Names that are both a package and a function: ``layertap.extract`` (the package of `extract_dataset`,
and `layertap.features.extract`) and ``layertap.tap`` (the package, and the function). On `layertap`
they are the functions; no import of a submodule, in any order, may rebind them, nor any other
package's public names."""

from __future__ import annotations

import subprocess
import sys
import textwrap

# run in a fresh interpreter: what a first import binds depends on what was imported before
PROBE = textwrap.dedent(
    """
    import importlib, pkgutil, sys
    import layertap

    def public(module):
        return {name: getattr(module, name) for name in getattr(module, "__all__", ())}

    packages = {name: m for name, m in sys.modules.items() if name.startswith("layertap") and hasattr(m, "__path__")}
    before = {name: public(m) for name, m in packages.items()}
    # extract/ imports every submodule at once: none is first imported by whoever needs it later
    extract = sys.modules["layertap.extract"]
    lazy = [i.name for i in pkgutil.iter_modules(extract.__path__, "layertap.extract.") if i.name not in sys.modules]
    assert not lazy, f"submodules of layertap.extract that import layertap does not import: {lazy}"

    for info in pkgutil.walk_packages(layertap.__path__, "layertap."):
        if info.name != "layertap.__main__":  # running it starts the command line
            importlib.import_module(info.name)

    assert layertap.extract is sys.modules["layertap.features"].extract, layertap.extract
    assert layertap.tap is sys.modules["layertap.tap.core"].tap, layertap.tap
    for name, names in before.items():
        changed = [n for n, value in public(packages[name]).items() if value is not names.get(n, value)]
        assert not changed, f"importing the submodules rebound {name}.{changed}"
    print("ok")
    """
)


def test_importing_every_submodule_leaves_extract_and_tap_the_functions():
    done = subprocess.run([sys.executable, "-c", PROBE], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0 and done.stdout.strip() == "ok", done.stderr[-2000:]
