from __future__ import annotations

import json

import pytest

from agentrl.data import DataError, TaskSource, read_rows
from agentrl.types import Task


def _tasks(n: int) -> list[Task]:
    return [Task(id=str(i), data={"q": i}) for i in range(n)]


def test_task_source_is_seeded_and_covers_each_epoch():
    a, b = TaskSource(_tasks(10), seed=3), TaskSource(_tasks(10), seed=3)
    first = [t.id for t in a.next_batch(10)]
    assert first == [t.id for t in b.next_batch(10)]
    assert sorted(first, key=int) == [str(i) for i in range(10)]
    second = [t.id for t in a.next_batch(10)]
    assert sorted(second, key=int) == sorted(first, key=int) and second != first


def test_task_source_resumes_same_order():
    src = TaskSource(_tasks(7), seed=1)
    src.next_batch(5)
    state = src.state()
    expected = [t.id for t in src.next_batch(9)]
    resumed = TaskSource(_tasks(7), seed=1)
    resumed.load_state(state)
    assert [t.id for t in resumed.next_batch(9)] == expected


def test_task_source_rejects_changed_data():
    src = TaskSource(_tasks(7))
    with pytest.raises(ValueError, match="resume with the same data"):
        TaskSource(_tasks(8)).load_state(src.state())


def test_read_rows_jsonl_and_parquet(tmp_path):
    rows = [
        {"question": "a?", "golden_answers": ["x"]},
        {"question": "b?", "golden_answers": ["y", "z"]},
    ]
    jl = tmp_path / "d.jsonl"
    jl.write_text("\n".join(json.dumps(r) for r in rows) + "\n\n")
    assert read_rows(jl) == rows
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "d.parquet")
    assert read_rows(tmp_path / "d.parquet") == rows


def test_read_rows_bad_line_names_line(tmp_path):
    p = tmp_path / "bad.jsonl"
    p.write_text('{"a": 1}\n{oops\n')
    with pytest.raises(DataError, match=r"bad.jsonl:2: not valid JSON"):
        read_rows(p)
    p.write_text('{"a": 1}\n[1, 2]\n')
    with pytest.raises(DataError, match=r"bad.jsonl:2: a JSON array, not an object"):
        read_rows(p)
    with pytest.raises(DataError, match=r"is a directory; pass a JSONL or parquet file"):
        read_rows(tmp_path)
    (tmp_path / "bad.parquet").write_text("not parquet")
    with pytest.raises(DataError, match=r"bad.parquet: not a readable parquet file"):
        read_rows(tmp_path / "bad.parquet")


def test_a_binary_file_is_a_data_error_naming_the_line(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.Table.from_pylist([{"q": "a"}]), tmp_path / "tasks.parquet")
    misnamed = tmp_path / "tasks.jsonl"  # parquet bytes under a JSONL name
    misnamed.write_bytes((tmp_path / "tasks.parquet").read_bytes())
    with pytest.raises(
        DataError, match=r"tasks.jsonl:1: binary data, not UTF-8 text \(byte 0x"
    ) as info:
        read_rows(misnamed)
    assert "parquet named *.parquet" in str(info.value)
    (tmp_path / "later.jsonl").write_bytes(b'{"q": 1}\n{"q": "\xff\xfe"}\n')
    with pytest.raises(
        DataError, match=r"later.jsonl:2: binary data, not UTF-8 text \(byte 0xff at column 8"
    ):
        read_rows(tmp_path / "later.jsonl")


def test_a_row_over_the_bound_is_refused_before_it_is_read_whole(tmp_path):
    path = tmp_path / "big.jsonl"
    fits = json.dumps({"q": "x" * 80})  # 89 bytes, and its newline
    path.write_text(fits + "\n" + json.dumps({"q": "x" * 200}) + "\n")
    with pytest.raises(DataError, match=r"big.jsonl:2: the line is longer than 100 bytes") as info:
        read_rows(path, max_row_bytes=100)
    assert "env.max_row_bytes" in str(info.value)
    assert read_rows(path, max_row_bytes=300)[1] == {"q": "x" * 200}
    path.write_text(fits)  # at the bound, without a final newline
    assert read_rows(path, max_row_bytes=len(fits)) == [{"q": "x" * 80}]
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.Table.from_pylist([{"q": "a"}, {"q": "x" * 200}]), tmp_path / "b.parquet")
    with pytest.raises(DataError, match=r"b.parquet:2: the row is longer than 100 bytes"):
        read_rows(tmp_path / "b.parquet", max_row_bytes=100)


def test_the_default_bound_refuses_a_50_mb_row(tmp_path):
    path = tmp_path / "huge.jsonl"
    with path.open("w") as f:
        f.write('{"q": "' + "x" * (50 * 1024 * 1024) + '"}\n')
    with pytest.raises(DataError, match=r"huge.jsonl:1: the line is longer than 4,194,304 bytes"):
        read_rows(path)


def test_task_source_skips_positions_a_checkpoint_marks_taken():
    tasks = _tasks(5)
    full = TaskSource(tasks, seed=3)
    order = [t.id for t in full.next_batch(8)]  # crosses into the second epoch
    src = TaskSource(tasks, seed=3)
    src.next_batch(1)
    state = {**src.state(), "skip": [1, 4]}  # places 2 and 5 of the order were already trained
    resumed = TaskSource(tasks, seed=0)
    resumed.load_state(state)
    assert [t.id for t in resumed.next_batch(2)] == [order[1], order[3]]
    assert resumed.state()["skip"] == [1]  # place 5 still ahead, now 1 past the cursor
    assert [t.id for t in resumed.next_batch(3)] == [order[4], order[6], order[7]]
    assert "skip" not in resumed.state()
