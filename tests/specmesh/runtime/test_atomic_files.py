"""Cache files written so that a reader never sees part of one (specmesh/runtime/atomic_files.py): whole files under
concurrent writers, nothing left behind on failure, and the written file's status for callers that tell their own
write from another's."""

from __future__ import annotations

import json
import os
import threading

import pytest

from specmesh.runtime.atomic_files import write_json_atomically, write_text_atomically


def test_the_file_is_written_whole_in_a_new_folder_readable_by_others(tmp_path):
    path = tmp_path / "new" / "folder" / "costs.json"
    status = write_json_atomically(path, {"v(0)": 0.031})
    assert json.loads(path.read_text()) == {"v(0)": 0.031}
    assert os.stat(path).st_mode & 0o777 == 0o644
    assert (status.st_ino, status.st_size) == (os.stat(path).st_ino, path.stat().st_size)
    assert os.listdir(path.parent) == ["costs.json"], "no temporary file left"


def test_concurrent_writers_and_readers_only_ever_see_whole_files(tmp_path):
    path = tmp_path / "learned.json"
    write_json_atomically(path, {"writer": -1, "pad": "x" * 50_000})
    torn, stop = [], threading.Event()

    def read() -> None:
        while not stop.is_set():
            try:
                json.loads(path.read_text())
            except ValueError as e:
                torn.append(e)

    def write(writer: int) -> None:
        for _ in range(50):
            write_json_atomically(path, {"writer": writer, "pad": "x" * 50_000})

    reader = threading.Thread(target=read)
    reader.start()
    writers = [threading.Thread(target=write, args=(n,)) for n in range(4)]
    for thread in writers:
        thread.start()
    for thread in writers:
        thread.join()
    stop.set()
    reader.join()
    assert not torn
    assert json.loads(path.read_text())["writer"] in range(4)
    assert os.listdir(tmp_path) == ["learned.json"]


def test_a_failed_write_leaves_the_old_file_and_no_temporary_one(tmp_path):
    path = tmp_path / "facts.json"
    write_text_atomically(path, "old")
    with pytest.raises(TypeError):
        write_json_atomically(path, {"not json": object()})
    (tmp_path / "facts.json.d").mkdir()
    with pytest.raises(OSError):
        write_text_atomically(tmp_path / "facts.json.d", "a folder is in the way")
    assert path.read_text() == "old"
    assert sorted(os.listdir(tmp_path)) == ["facts.json", "facts.json.d"]
