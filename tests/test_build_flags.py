"""csrc/build_flags.py: the key that decides whether a prebuilt attention unit may be linked
instead of compiled (setup.py, FLASH_ATTN_PREBUILT_DIR) changes with everything the unit's object
depends on, and with nothing else."""

import importlib.util
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
spec = importlib.util.spec_from_file_location("build_flags", ROOT / "csrc" / "build_flags.py")
build_flags = importlib.util.module_from_spec(spec)
spec.loader.exec_module(build_flags)


def _tree(tmp_path):
    src = tmp_path / "src"
    (src / "generated").mkdir(parents=True)
    (tmp_path / "cutlass" / "cutlass").mkdir(parents=True)
    (tmp_path / "cutlass" / "cutlass" / "version.h").write_text("#define CUTLASS_MAJOR 4\n")
    (src / "launch.h").write_text('#pragma once\n#include "kernel.h"\n#include <cute/tensor.hpp>\n')
    (src / "kernel.h").write_text("#pragma once\n// kernel v1\n")
    (src / "unrelated.h").write_text("// not included by the unit\n")
    unit = src / "generated" / "unit.cu"
    unit.write_text('#include "launch.h"\ntemplate void f<1>();\n')
    return unit, src, tmp_path / "cutlass"


def test_key_follows_the_unit_its_headers_cutlass_and_flags(tmp_path):
    unit, src, cutlass = _tree(tmp_path)
    flags = ["-O3", "-gencode", "arch=compute_90a,code=sm_90a"]
    key = build_flags.unit_key(unit, src, cutlass, flags)
    assert key == build_flags.unit_key(unit, src, cutlass, list(flags))  # deterministic

    (src / "unrelated.h").write_text("// edited\n")
    assert build_flags.unit_key(unit, src, cutlass, flags) == key  # not a dependency

    (src / "kernel.h").write_text("#pragma once\n// kernel v2\n")  # reached through launch.h
    key_kernel = build_flags.unit_key(unit, src, cutlass, flags)
    assert key_kernel != key

    (cutlass / "cutlass" / "version.h").write_text("#define CUTLASS_MAJOR 5\n")
    key_cutlass = build_flags.unit_key(unit, src, cutlass, flags)
    assert key_cutlass != key_kernel

    assert build_flags.unit_key(unit, src, cutlass, flags[:1] + ["arch=compute_80,code=sm_80"]) != key_cutlass

    unit.write_text('#include "launch.h"\ntemplate void f<2>();\n')
    assert build_flags.unit_key(unit, src, cutlass, flags) != key_cutlass


def test_key_does_not_depend_on_where_the_tree_is(tmp_path):
    a = _tree(tmp_path / "a")
    b = _tree(tmp_path / "b")
    flags = ["-O3"]
    assert build_flags.unit_key(*a, flags) == build_flags.unit_key(*b, flags)


def test_gencode_builds_sm90_as_sm90a():
    assert build_flags.gencode_flags(["80", "90"]) == [
        "-gencode", "arch=compute_80,code=sm_80", "-gencode", "arch=compute_90a,code=sm_90a"]
