"""Which host C++ compiler builds the extensions: one PyTorch's C++ errors can cross.

A TORCH_CHECK error is thrown in libc10 and caught in the extension, so both must use the one
shared C++ runtime (libstdc++.so.6) PyTorch runs on. The GPU machine's CXX (/opt/gcc/bin/g++, a
GCC 13.3 wrapper) finds no libstdc++.so, links a private static copy into every extension, and
each TORCH_CHECK failure there died with SIGSEGV; the system g++ 13 works. A compiler qualifies
when it is a GCC of the major version PyTorch was built with and passes the exception probe: a
small library built with it uses the shared runtime's __cxa_throw and turns a TORCH_CHECK error
into RuntimeError, in a fresh interpreter. setup.py calls choose() and exports the choice as CXX
and CC (CC is also nvcc's host compiler through torch's -ccbin).
"""

import os
import re
import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path

SKIP_CHECK_VAR = "FLASH_ATTN_ANY_HOST_COMPILER"


class HostCompilerError(RuntimeError):
    """No host compiler compatible with the installed PyTorch was found."""


@dataclass(frozen=True)
class Compiler:
    path: str
    family: str  # "gcc" or "clang"
    version: str  # "13.3.0"

    @property
    def major(self):
        return int(self.version.split(".")[0])


@dataclass(frozen=True)
class Choice:
    cxx: str
    cc: str
    message: str


def torch_gcc_major(torch_config):
    """The GCC major version in torch.__config__.show(), or None (clang or unknown)."""
    match = re.search(r"\bGCC (\d+)\.\d+", torch_config)
    return int(match.group(1)) if match else None


def identify(path):
    """The compiler family and version of the executable at path, from its predefined macros;
    None when it is not a working C++ compiler."""
    try:
        result = subprocess.run([path, "-dM", "-E", "-x", "c++", os.devnull], capture_output=True,
                                text=True, timeout=60)
    except (OSError, subprocess.TimeoutExpired):
        return None
    if result.returncode != 0:
        return None
    macros = dict(re.findall(r"^#define (\w+) (.*)$", result.stdout, re.M))
    if "__clang__" in macros:
        keys, family = ("__clang_major__", "__clang_minor__", "__clang_patchlevel__"), "clang"
    elif "__GNUC__" in macros:
        keys, family = ("__GNUC__", "__GNUC_MINOR__", "__GNUC_PATCHLEVEL__"), "gcc"
    else:
        return None
    return Compiler(path, family, ".".join(macros.get(k, "0") for k in keys))


def _candidates(env, major):
    """CXX first, then the usual names of a GCC of that major version, each path once."""
    names = [env.get("CXX"), f"g++-{major}", "g++", "c++",
             f"/usr/bin/g++-{major}", "/usr/bin/g++", "/usr/bin/c++"]
    seen = set()
    for name in names:
        path = shutil.which(name, path=env.get("PATH")) if name else None
        if path and os.path.realpath(path) not in seen:
            seen.add(os.path.realpath(path))
            yield path


def _c_sibling(cxx):
    """The C driver beside a C++ driver (g++-13 -> gcc-13, c++ -> cc) if it is the same compiler;
    else the C++ driver itself, which compiles and links C as well."""
    path = Path(cxx)
    for cpp_name, c_name in (("g++", "gcc"), ("c++", "cc"), ("clang++", "clang")):
        if cpp_name in path.name:
            sibling = path.with_name(path.name.replace(cpp_name, c_name))
            found, mine = identify(str(sibling)) if sibling.is_file() else None, identify(cxx)
            if found is not None and mine is not None and found.version == mine.version:
                return str(sibling)
    return cxx


def _describe(compiler):
    return f"{compiler.family} {compiler.version}" if compiler else "not a working C++ compiler"


# A Python extension as small as it gets that fails the way ours do: a TORCH_CHECK raised in
# libc10, caught and translated by pybind11 in the extension (its exception_ptr and rethrow go
# through the C++ runtime the extension was linked with).
PROBE_SOURCE = r"""
#include <c10/util/Exception.h>
#include <pybind11/pybind11.h>
static void fail() { TORCH_CHECK(false, "flash_attn host compiler probe"); }
PYBIND11_MODULE(flash_attn_compiler_probe, m) { m.def("fail", &fail); }
"""

# Run in a fresh interpreter beside the probe library. Exit 4: the library carries its own copy of
# the C++ runtime's exception machinery. dlsym on the library's handle finds its own definition
# before libstdc++'s, so a differing address means a private copy (a compiler that finds no shared
# libstdc++.so links the static one in). Such an extension can die with SIGSEGV on the first C++
# error (the GPU machine's CXX), or survive it (a plain -static-libstdc++ build here), so the
# address is checked, not just the outcome of one throw.
PROBE_RUN = r"""
import ctypes, sys, torch
sys.path.insert(0, {folder!r})
import flash_attn_compiler_probe as probe
try:
    shared = ctypes.CDLL("libstdc++.so.6")
except OSError:
    shared = None  # not a libstdc++ process: nothing to compare
if shared is not None:
    own = ctypes.CDLL(probe.__file__)
    address = lambda library, name: ctypes.cast(getattr(library, name), ctypes.c_void_p).value
    if any(address(own, name) != address(shared, name) for name in ("__cxa_throw", "__gxx_personality_v0")):
        sys.exit(4)
try:
    probe.fail()
except RuntimeError:
    sys.exit(0)
sys.exit(3)
"""


def throw_probe(cxx, torch_include_dirs, torch_library_dir, python):
    """(True, "") when an extension built by cxx uses PyTorch's shared C++ runtime and turns a
    TORCH_CHECK failure into a Python RuntimeError; else (False, what went wrong)."""
    import sysconfig
    import tempfile

    suffix = sysconfig.get_config_var("EXT_SUFFIX") or ".so"
    with tempfile.TemporaryDirectory(prefix="flash_attn_probe_") as tmp:
        source = Path(tmp) / "probe.cpp"
        library = Path(tmp) / f"flash_attn_compiler_probe{suffix}"
        source.write_text(PROBE_SOURCE)
        includes = [*torch_include_dirs, sysconfig.get_paths()["include"]]
        built = None
        # PyTorch's headers ask for C++20 from 2.13 on, C++17 before.
        for standard in ("c++20", "c++17"):
            command = [cxx, f"-std={standard}", "-O1", "-fPIC", "-shared", str(source), "-o",
                       str(library), *[f"-I{d}" for d in includes], f"-L{torch_library_dir}",
                       "-lc10", f"-Wl,-rpath,{torch_library_dir}"]
            try:
                built = subprocess.run(command, capture_output=True, text=True, timeout=300)
            except (OSError, subprocess.TimeoutExpired) as error:
                return False, f"could not build the probe ({error})"
            if built.returncode == 0:
                break
        if built.returncode != 0:
            return False, f"could not build the probe: {built.stderr.strip().splitlines()[-1:]}"
        ran = subprocess.run([python, "-c", PROBE_RUN.format(folder=tmp)], capture_output=True,
                             text=True, timeout=300)
    if ran.returncode == 0:
        return True, ""
    if ran.returncode < 0:
        return False, f"a C++ error thrown through PyTorch killed the process (signal {-ran.returncode})"
    if ran.returncode == 4:
        return False, ("it links a private copy of the C++ runtime into the extension instead of the "
                       "shared libstdc++ PyTorch uses (it finds no libstdc++.so), so PyTorch's C++ "
                       "errors cannot be caught there")
    return False, f"the probe did not turn PyTorch's C++ error into RuntimeError (exit {ran.returncode})"


def choose(torch_config, env, probe=None):
    """The host compiler for the build, or HostCompilerError saying why there is none. probe(cxx)
    -> (ok, why not) is run on each GCC of the right major version, CXX first (throw_probe in
    setup.py)."""
    wanted = torch_gcc_major(torch_config)
    given = env.get("CXX")
    given_path = shutil.which(given, path=env.get("PATH")) if given else None
    skip = env.get(SKIP_CHECK_VAR, "").strip().lower() in ("1", "true", "yes", "on")
    if skip or wanted is None:
        cxx = given_path or shutil.which("c++", path=env.get("PATH")) or given or "c++"
        why = f"{SKIP_CHECK_VAR} is set" if skip else "PyTorch's build names no GCC version"
        return Choice(cxx, _c_sibling(cxx),
                      f"host compiler {cxx} ({_describe(identify(cxx))}), unchecked: {why}")
    rejected = {}  # path -> why
    for path in _candidates(env, wanted):
        found = identify(path)
        if found is None or found.family != "gcc" or found.major != wanted:
            rejected[path] = f"{_describe(found)}, not GCC {wanted}"
            continue
        ok, why = probe(path) if probe is not None else (True, "")
        if not ok:
            rejected[path] = f"GCC {found.version}, but {why}"
            continue
        note = ""
        if given and (given_path is None or os.path.realpath(given_path) != os.path.realpath(path)):
            reason = rejected.get(given_path) or _describe(identify(given_path or given))
            note = f"; CXX={given} was not used ({reason})"
        checked = " that passed the exception probe" if probe is not None else ""
        return Choice(path, _c_sibling(path),
                      f"host compiler {path} (GCC {found.version}), of the GCC major version "
                      f"PyTorch was built with{checked}{note}")
    cxx_part = (f"CXX={given} is {rejected.get(given_path) or _describe(identify(given_path or given))}"
                if given else "CXX is not set")
    others = "; ".join(f"{p}: {why}" for p, why in rejected.items() if p != given_path)
    raise HostCompilerError(
        f"no usable GCC {wanted} (the GCC major version PyTorch was built with) found: {cxx_part}"
        f"{'; ' + others if others else ''}. An extension built by such a compiler can crash "
        f"(SIGSEGV) whenever C++ raises an error. Install GCC {wanted} and point CXX at its g++, "
        f"or set {SKIP_CHECK_VAR}=1 to build with CXX anyway.")
