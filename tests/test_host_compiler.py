"""csrc/host_compiler.py: the build uses a GCC of PyTorch's major version, whatever CXX says, or
stops naming CXX. Fake compilers (scripts answering -dM -E with GCC or clang macros) stand in for
real ones."""

import importlib.util
import os
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
spec = importlib.util.spec_from_file_location("host_compiler", ROOT / "csrc" / "host_compiler.py")
host_compiler = importlib.util.module_from_spec(spec)
spec.loader.exec_module(host_compiler)

TORCH_CONFIG = "PyTorch built with:\n  - GCC 13.3\n  - C++ Version: 202002\n"


def fake_compiler(folder, name, family, version):
    major, minor, patch = version.split(".")
    if family == "gcc":
        macros = f"#define __GNUC__ {major}\n#define __GNUC_MINOR__ {minor}\n#define __GNUC_PATCHLEVEL__ {patch}"
    else:
        macros = (f"#define __clang__ 1\n#define __clang_major__ {major}\n"
                  f"#define __clang_minor__ {minor}\n#define __clang_patchlevel__ {patch}\n"
                  "#define __GNUC__ 4")
    path = folder / name
    path.write_text(f"#!/bin/sh\ncat <<'EOF'\n{macros}\nEOF\n")
    path.chmod(0o755)
    return str(path)


@pytest.fixture
def compilers(tmp_path):
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    made = {
        "g++-13": fake_compiler(bin_dir, "g++-13", "gcc", "13.2.0"),
        "gcc-13": fake_compiler(bin_dir, "gcc-13", "gcc", "13.2.0"),
        "g++": fake_compiler(bin_dir, "g++", "gcc", "12.2.0"),
    }
    other = tmp_path / "toolchain"
    other.mkdir()
    made["other"] = fake_compiler(other, "g++", "gcc", "14.1.0")
    made["clang++"] = fake_compiler(other, "clang++", "clang", "17.0.1")
    return made, str(bin_dir)


def test_torch_gcc_major_is_read_from_the_build_config():
    assert host_compiler.torch_gcc_major(TORCH_CONFIG) == 13
    assert host_compiler.torch_gcc_major("PyTorch built with:\n  - clang 17.0\n") is None


def test_identify_tells_gcc_from_clang(compilers):
    made, _ = compilers
    assert host_compiler.identify(made["g++-13"]) == host_compiler.Compiler(made["g++-13"], "gcc", "13.2.0")
    assert host_compiler.identify(made["clang++"]).family == "clang"
    assert host_compiler.identify("/nonexistent/g++") is None


def test_a_cxx_of_another_gcc_is_replaced_by_the_matching_one(compilers):
    made, bin_dir = compilers
    choice = host_compiler.choose(TORCH_CONFIG, {"PATH": bin_dir, "CXX": made["other"]})
    assert choice.cxx == made["g++-13"] and choice.cc.endswith("gcc-13")
    assert "GCC 13.2.0" in choice.message and f"CXX={made['other']} (gcc 14.1.0) was not used" in choice.message


def test_a_matching_cxx_is_kept(compilers):
    made, bin_dir = compilers
    choice = host_compiler.choose(TORCH_CONFIG, {"PATH": bin_dir, "CXX": made["g++-13"]})
    assert choice.cxx == made["g++-13"] and "was not used" not in choice.message


def test_no_matching_gcc_stops_the_build_naming_cxx(compilers, tmp_path):
    made, _ = compilers
    only_other = str(Path(made["other"]).parent)
    with pytest.raises(host_compiler.HostCompilerError, match=r"no GCC 13 found.*CXX=.*clang 17\.0\.1"):
        host_compiler.choose(TORCH_CONFIG, {"PATH": only_other, "CXX": made["clang++"]})
    with pytest.raises(host_compiler.HostCompilerError, match="CXX is not set"):
        host_compiler.choose(TORCH_CONFIG, {"PATH": only_other})


def test_the_check_can_be_skipped_or_does_not_apply(compilers):
    made, bin_dir = compilers
    env = {"PATH": bin_dir, "CXX": made["other"], host_compiler.SKIP_CHECK_VAR: "1"}
    choice = host_compiler.choose(TORCH_CONFIG, env)
    assert choice.cxx == made["other"] and "unchecked" in choice.message
    choice = host_compiler.choose("PyTorch built with:\n  - clang 17.0\n", {"PATH": bin_dir})
    assert "unchecked" in choice.message and "names no GCC version" in choice.message


def test_this_machine_has_a_usable_answer():
    """On the machine running the tests, choose() either finds a compiler or says why not."""
    try:
        import torch
        config = torch.__config__.show()
    except ImportError:
        pytest.skip("no torch")
    try:
        choice = host_compiler.choose(config, dict(os.environ))
    except host_compiler.HostCompilerError as error:
        assert "GCC" in str(error)
    else:
        assert os.path.exists(choice.cxx)
