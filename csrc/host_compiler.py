"""Which host C++ compiler builds the extensions: a GCC of the major version PyTorch was built with.

An extension compiled by another GCC than PyTorch's can die with SIGSEGV whenever C++ throws
(seen on the GPU machine, whose CXX names another GCC than the system one), instead of the error
reaching Python as a RuntimeError: the exception crosses between the extension and libc10, so both
must agree on the C++ runtime. setup.py calls choose() and exports the choice as CXX and CC (CC is
also nvcc's host compiler through torch's -ccbin).
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


def choose(torch_config, env):
    """The host compiler for the build, or HostCompilerError saying why there is none."""
    wanted = torch_gcc_major(torch_config)
    given = env.get("CXX")
    given_path = shutil.which(given, path=env.get("PATH")) if given else None
    skip = env.get(SKIP_CHECK_VAR, "").strip().lower() in ("1", "true", "yes", "on")
    if skip or wanted is None:
        cxx = given_path or shutil.which("c++", path=env.get("PATH")) or given or "c++"
        why = f"{SKIP_CHECK_VAR} is set" if skip else "PyTorch's build names no GCC version"
        return Choice(cxx, _c_sibling(cxx),
                      f"host compiler {cxx} ({_describe(identify(cxx))}), unchecked: {why}")
    for path in _candidates(env, wanted):
        found = identify(path)
        if found is not None and found.family == "gcc" and found.major == wanted:
            note = ""
            if given and (given_path is None or os.path.realpath(given_path) != os.path.realpath(path)):
                note = f"; CXX={given} ({_describe(identify(given_path or given))}) was not used"
            return Choice(path, _c_sibling(path),
                          f"host compiler {path} (GCC {found.version}), the GCC major version "
                          f"PyTorch was built with{note}")
    cxx_part = (f"CXX={given} is {_describe(identify(given_path or given))}" if given
                else "CXX is not set")
    raise HostCompilerError(
        f"no GCC {wanted} found, the GCC major version PyTorch was built with: {cxx_part}, and "
        f"no g++-{wanted}, g++ or c++ on PATH is GCC {wanted}. An extension built by another "
        f"compiler can crash (SIGSEGV) whenever C++ raises an error. Install GCC {wanted} and "
        f"point CXX at its g++, or set {SKIP_CHECK_VAR}=1 to build with CXX anyway.")
