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

# A GCC major no real compiler on the test machine has, so only the fakes can match it.
TORCH_CONFIG = "PyTorch built with:\n  - GCC 93.3\n  - C++ Version: 202002\n"


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
        "g++-93": fake_compiler(bin_dir, "g++-93", "gcc", "93.2.0"),
        "gcc-93": fake_compiler(bin_dir, "gcc-93", "gcc", "93.2.0"),
        "g++": fake_compiler(bin_dir, "g++", "gcc", "92.2.0"),
    }
    other = tmp_path / "toolchain"
    other.mkdir()
    made["other"] = fake_compiler(other, "g++", "gcc", "94.1.0")
    made["clang++"] = fake_compiler(other, "clang++", "clang", "17.0.1")
    return made, str(bin_dir)


def test_torch_gcc_major_is_read_from_the_build_config():
    assert host_compiler.torch_gcc_major(TORCH_CONFIG) == 93
    assert host_compiler.torch_gcc_major("PyTorch built with:\n  - clang 17.0\n") is None


def test_identify_tells_gcc_from_clang(compilers):
    made, _ = compilers
    assert host_compiler.identify(made["g++-93"]) == host_compiler.Compiler(made["g++-93"], "gcc", "93.2.0")
    assert host_compiler.identify(made["clang++"]).family == "clang"
    assert host_compiler.identify("/nonexistent/g++") is None


def test_a_cxx_of_another_gcc_is_replaced_by_the_matching_one(compilers):
    made, bin_dir = compilers
    choice = host_compiler.choose(TORCH_CONFIG, {"PATH": bin_dir, "CXX": made["other"]})
    assert choice.cxx == made["g++-93"] and choice.cc.endswith("gcc-93")
    assert "GCC 93.2.0" in choice.message
    assert f"CXX={made['other']} was not used (gcc 94.1.0, not GCC 93)" in choice.message


def test_a_matching_cxx_is_kept(compilers):
    made, bin_dir = compilers
    choice = host_compiler.choose(TORCH_CONFIG, {"PATH": bin_dir, "CXX": made["g++-93"]})
    assert choice.cxx == made["g++-93"] and "was not used" not in choice.message


def test_no_matching_gcc_stops_the_build_naming_cxx(compilers, tmp_path):
    made, _ = compilers
    only_other = str(Path(made["other"]).parent)
    with pytest.raises(host_compiler.HostCompilerError, match=r"no usable GCC 93 .*CXX=.*clang 17\.0\.1"):
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


def test_a_compiler_failing_the_probe_is_passed_over(compilers):
    """The GPU machine's case: CXX is a GCC of the right major version whose extensions crash."""
    made, bin_dir = compilers
    other_93 = fake_compiler(Path(made["other"]).parent, "g++-93", "gcc", "93.3.0")
    crashes = {other_93: "a C++ error thrown through PyTorch killed the process (signal 11)"}

    def probe(cxx):
        return (cxx not in crashes), crashes.get(cxx, "")

    env = {"PATH": bin_dir, "CXX": other_93}
    choice = host_compiler.choose(TORCH_CONFIG, env, probe=probe)
    assert choice.cxx == made["g++-93"] and "passed the exception probe" in choice.message
    assert f"CXX={other_93} was not used (GCC 93.3.0, but a C++ error thrown" in choice.message
    with pytest.raises(host_compiler.HostCompilerError, match=r"CXX=.*GCC 93\.3\.0, but a C\+\+ error"):
        host_compiler.choose(TORCH_CONFIG, env, probe=lambda cxx: (False, crashes.get(cxx, "no")))


def _torch_paths():
    torch = pytest.importorskip("torch")
    from torch.utils.cpp_extension import include_paths, library_paths

    return torch, include_paths(), library_paths()[0]


def test_throw_probe_passes_a_working_compiler():
    import shutil
    import sys

    _, includes, libdir = _torch_paths()
    cxx = shutil.which("g++") or shutil.which("c++")
    if cxx is None:
        pytest.skip("no C++ compiler here")
    ok, why = host_compiler.throw_probe(cxx, includes, libdir, sys.executable)
    assert ok, why


def test_throw_probe_catches_a_crashing_library(tmp_path):
    """A 'compiler' whose library crashes when called stands in for the broken toolchain."""
    import shutil
    import sys

    _, includes, libdir = _torch_paths()
    cc = shutil.which("gcc") or shutil.which("cc")
    if cc is None:
        pytest.skip("no C compiler here")
    crash_c = tmp_path / "crash.c"
    # An importable module whose initialisation crashes: what the real crash looks like from Python.
    crash_c.write_text("void *PyInit_flash_attn_compiler_probe(void) { volatile int *p = 0; *p = 1; return 0; }\n")
    fake = tmp_path / "crashing-g++"
    fake.write_text(f"#!/bin/sh\nout=\nprev=\nfor a in \"$@\"; do [ \"$prev\" = -o ] && out=$a; prev=$a; done\n"
                    f"exec {cc} -shared -fPIC {crash_c} -o \"$out\"\n")
    fake.chmod(0o755)
    ok, why = host_compiler.throw_probe(str(fake), includes, libdir, sys.executable)
    assert not ok and "killed the process (signal 11)" in why
    broken = tmp_path / "broken-g++"
    broken.write_text("#!/bin/sh\necho 'no such toolchain' >&2\nexit 1\n")
    broken.chmod(0o755)
    ok, why = host_compiler.throw_probe(str(broken), includes, libdir, sys.executable)
    assert not ok and "could not build the probe" in why


def test_throw_probe_rejects_a_private_cpp_runtime(tmp_path):
    """The GPU machine's case: its CXX finds no libstdc++.so and links a static copy into each
    extension. -static-libstdc++ does the same with the g++ here; the probe must reject it even
    where one throw happens to survive it."""
    import shutil
    import sys

    _, includes, libdir = _torch_paths()
    cxx = shutil.which("g++")
    if cxx is None:
        pytest.skip("no g++ here")
    fake = tmp_path / "static-runtime-g++"
    fake.write_text(f'#!/bin/sh\nexec {cxx} -static-libstdc++ "$@"\n')
    fake.chmod(0o755)
    ok, why = host_compiler.throw_probe(str(fake), includes, libdir, sys.executable)
    assert not ok and "private copy of the C++ runtime" in why
