"""What prepare.sh adds to the wheels the GPU machine lacks: the project's pins of the libraries the GPU image
has in other versions (transformers, tokenizers, peft: pyproject.toml's `==` pins), so the GPU runs what
`make install` installs, and a bitsandbytes wheel slimmed to the GPU image's CUDA major, so all of it fits
the 64 MiB a call carries.

    python -m benchmarks.gpu.wheels .whl        # fills .whl/pinned/, slims .whl/bitsandbytes-*.whl
"""

from __future__ import annotations

import argparse
import re
import subprocess
import sys
import tomllib
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent.parent
PINNED = ("transformers", "tokenizers", "peft")  # the GPU image's own torch and accelerate are used
CUDA_MAJOR = "13"  # the GPU image's torch is built for CUDA 13 (../shared/gpu/README.md; versions.json says)
PLATFORMS = ("manylinux_2_28_x86_64", "manylinux_2_17_x86_64", "manylinux2014_x86_64")


def pins(pyproject: Path = ROOT / "pyproject.toml", names=PINNED) -> dict[str, str]:
    """{name: version} for each of `names` that pyproject.toml's dependencies pin with `==`."""
    found = {}
    for requirement in tomllib.loads(pyproject.read_text())["project"]["dependencies"]:
        match = re.fullmatch(r"([A-Za-z0-9_.-]+)\s*==\s*([^\s;,]+)", requirement.strip())
        if match and match[1].lower() in names:
            found[match[1].lower()] = match[2]
    return found


def download_pinned(dest: Path, wanted: dict[str, str]) -> None:
    """Each pinned wheel for the GPU machine's CPython 3.12 on x86-64 into `dest`, unless one is there."""
    dest.mkdir(parents=True, exist_ok=True)
    missing = [f"{name}=={version}" for name, version in wanted.items()
               if not list(dest.glob(f"{name}-{version}-*.whl"))]
    if not missing:
        return
    platforms = [arg for p in PLATFORMS for arg in ("--platform", p)]
    subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--only-binary=:all:",
                    "--python-version", "3.12", "--implementation", "cp", *platforms, "-d", str(dest), *missing],
                   check=True)


def slim(wheel: Path, cuda_major: str = CUDA_MAJOR) -> int:
    """Rewrite `wheel` without the native libraries of other CUDA majors and of ROCm (its CPU library and
    its Python stay), and without their lines in its RECORD; returns the bytes dropped (0: already slim)."""
    pattern = re.compile(r"(^|/)lib[^/]*_(cuda(?P<cuda>\d+)|rocm\d+)\.(so|dll|dylib)$")

    def dropped(name: str) -> bool:
        match = pattern.search(name)
        return bool(match) and not (match["cuda"] or "").startswith(cuda_major)

    with zipfile.ZipFile(wheel) as source:
        infos = source.infolist()
        gone = [i for i in infos if dropped(i.filename)]
        if not gone:
            return 0
        kept = [i for i in infos if not dropped(i.filename)]
        slimmed = wheel.with_suffix(".slim")
        with zipfile.ZipFile(slimmed, "w", zipfile.ZIP_DEFLATED) as out:
            for info in kept:
                data = source.read(info)
                if info.filename.endswith(".dist-info/RECORD"):
                    names = {i.filename for i in gone}
                    data = "".join(line for line in data.decode().splitlines(keepends=True)
                                   if line.split(",", 1)[0] not in names).encode()
                out.writestr(info, data, compress_type=zipfile.ZIP_DEFLATED)
    before = wheel.stat().st_size
    slimmed.replace(wheel)
    return before - wheel.stat().st_size


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("wheels", type=Path, help="The folder of the wheels the GPU machine lacks (.whl).")
    args = parser.parse_args(argv)
    wanted = pins()
    download_pinned(args.wheels / "pinned", wanted)
    for wheel in args.wheels.glob("bitsandbytes-*.whl"):
        if freed := slim(wheel):
            print(f"{wheel.name}: kept the CUDA {CUDA_MAJOR} and CPU libraries ({freed / 2**20:.0f} MiB dropped)")
    print("pinned for the GPU machine: " + ", ".join(f"{n} {v}" for n, v in wanted.items()))


if __name__ == "__main__":
    main()
