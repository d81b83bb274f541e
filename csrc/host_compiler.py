"""Which host C++ compiler builds the extensions: one PyTorch's C++ errors can cross.

An extension built with the wrong toolchain can die with SIGSEGV whenever C++ throws, instead of
the error reaching Python as a RuntimeError (seen on the GPU machine: its CXX is a GCC 13.3 of
PyTorch's own major version, but a wrapper linking its own runtime files, and every TORCH_CHECK
failure crashed; the system g++ 13 worked). The exception is thrown in libc10 and caught in the
extension, so both must agree on the C++ runtime. A compiler qualifies when it is a GCC of the
major version PyTorch was built with and passes the exception probe: a small shared library built
with it like an extension catches a TORCH_CHECK error thrown by libc10, in a fresh interpreter.
setup.py calls choose() and exports the choice as CXX and CC (CC is also nvcc's host compiler
through torch's -ccbin).
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


def throw_probe(cxx, torch_include_dirs, torch_library_dir, python):
    """(True, "") when an extension built by cxx (compiled and linked as torch builds one) turns a
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
        code = ("import sys, torch\n"
                f"sys.path.insert(0, {tmp!r})\n"
                "import flash_attn_compiler_probe as probe\n"
                "try:\n    probe.fail()\nexcept RuntimeError:\n    sys.exit(0)\nsys.exit(3)\n")
        ran = subprocess.run([python, "-c", code], capture_output=True, text=True, timeout=300)
    if ran.returncode == 0:
        return True, ""
    if ran.returncode < 0:
        return False, f"a C++ error thrown through PyTorch killed the process (signal {-ran.returncode})"
    return False, f"the probe did not turn PyTorch's C++ error into RuntimeError (exit {ran.returncode})"


RUNTIME_LIBRARIES = {"libstdc++": "libstdc++.so", "libgcc_s": "libgcc_s.so.1"}


def linked_runtime(cxx):
    """{library: real path} of the C++ runtime libraries a library built by cxx links."""
    paths = {}
    for name, query in RUNTIME_LIBRARIES.items():
        try:
            out = subprocess.run([cxx, f"-print-file-name={query}"], capture_output=True,
                                 text=True, timeout=60).stdout.strip()
        except (OSError, subprocess.TimeoutExpired):
            out = ""
        paths[name] = os.path.realpath(out) if os.path.isabs(out) else None
    return paths


def loaded_runtime(python):
    """{library: real path} of the C++ runtime libraries a Python process runs on once torch is
    imported (Linux: from /proc/self/maps); empty where that cannot be read."""
    code = ("import os, torch\n"
            "for line in open('/proc/self/maps'):\n"
            "    path = line.split()[-1]\n"
            f"    for name in {list(RUNTIME_LIBRARIES)!r}:\n"
            "        if os.path.basename(path).startswith(name + '.so'):\n"
            "            print(name, os.path.realpath(path))\n")
    try:
        out = subprocess.run([python, "-c", code], capture_output=True, text=True, timeout=300)
    except (OSError, subprocess.TimeoutExpired):
        return {}
    return dict(line.split(" ", 1) for line in out.stdout.splitlines() if " " in line)


def choose(torch_config, env, probe=None, runtime=None, linked=linked_runtime):
    """The host compiler for the build, or HostCompilerError saying why there is none. probe(cxx)
    -> (ok, why not) is run on each GCC of the right major version (throw_probe in setup.py).
    runtime: loaded_runtime()'s answer; compilers that link those very libraries are tried first
    (the GPU machine's CXX is a GCC 13.3 wrapper that links its own copies, and its extensions
    crashed on every C++ error though both probes passed)."""
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
    candidates = list(_candidates(env, wanted))
    foreign = {}  # path -> the runtime library it links that PyTorch's process does not load
    if runtime:
        for path in candidates:
            mine = linked(path)
            differs = [f"{mine[n]} (PyTorch runs on {runtime[n]})" for n in runtime
                       if mine.get(n) and mine[n] != runtime[n]]
            if differs:
                foreign[path] = differs[0]
        candidates.sort(key=lambda p: p in foreign)  # stable: CXX first among equals
    for path in candidates:
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
            reason = (rejected.get(given_path) or
                      (f"it links {foreign[given_path]}" if given_path in foreign else None) or
                      _describe(identify(given_path or given)))
            note = f"; CXX={given} was not used ({reason})"
        if path in foreign:
            note += f"; it links {foreign[path]}"
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
