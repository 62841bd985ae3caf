"""benchmarks/render.py: a record a benchmark wrote goes in, the README's table comes out; what no record backs
is an error."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parent.parent / "benchmarks"
sys.path.insert(0, str(BENCH))

import records  # noqa: E402
import render  # noqa: E402

ZEN1 = {"cpu": "AMD EPYC 7551", "vendor": "AuthenticAMD", "family": 23, "model": 1, "flags": ["avx2", "fma"],
        "cores": 2, "l3_bytes": 8 << 20, "read_gbs": 19.7}
ZEN3 = {**ZEN1, "cpu": "AMD EPYC 7B13", "family": 25, "l3_bytes": 32 << 20, "read_gbs": 24.9}
PAGE = "# Sampling\n\nintro\n\n<!-- results:sampling:top_k -->\nold numbers\n<!-- /results -->\n\nafter\n"


def write_record(folder: Path, mach: dict, rows: list[list[str]], command: str = "python bench.py --quick",
                 date: str | None = None) -> records.Recorder:
    rec = records.Recorder("sampling", command=command, bandwidth=False)
    rec.machine = dict(mach)
    if date:
        rec.started = rec.started.fromisoformat(date)
    t = rec.table("top_k", "T=0.8, top-k=50", ["B", "V", "lmhead ms", "hf ms", "hf/lmhead"])
    for row in rows:
        t.row(row, [records.Figure(f"B={row[0]}", float(row[2]), "ms", "hf", float(row[3]))])
    rec.write(folder)
    return rec


def test_a_record_in_gives_its_table_out_with_command_commit_and_machine(tmp_path):
    write_record(tmp_path, ZEN1, [["1", "49152", "0.41", "6.36", "15.5×"], ["8", "49152", "1.18", "99.28", "84.1×"]])
    out = render.render_text(PAGE, tmp_path, records.machine_kind(ZEN1))
    block = out.split("<!-- results:sampling:top_k -->\n")[1].split("<!-- /results -->")[0]
    assert "old numbers" not in out and out.endswith("<!-- /results -->\n\nafter\n")
    assert "| B | V | lmhead ms | hf ms | hf/lmhead |" in block
    assert "| 1 | 49152 | 0.41 | 6.36 | 15.5× |" in block and "| 8 | 49152 | 1.18 | 99.28 | 84.1× |" in block
    assert "`python bench.py --quick`" in block
    assert "AMD EPYC 7551 (AuthenticAMD family 23 model 1; avx2 fma), 2 cores, 8 MiB L3, 19.7 GB/s read" in block
    sha = records.commit()["commit"]
    assert sha and sha[:10] in block
    assert "another machine kind" not in block
    # rendering is idempotent: the rendered page renders to itself
    assert render.render_text(out, tmp_path, records.machine_kind(ZEN1)) == out


def test_the_record_holds_each_figure_with_its_baseline_and_ratio_and_the_load(tmp_path):
    write_record(tmp_path, ZEN1, [["1", "49152", "0.5", "6.0", "12.0×"]])
    record = json.loads((tmp_path / "sampling.json").read_text())["tables"]["top_k"]["AuthenticAMD family 23 model 1"]
    assert record["figures"] == [{"what": "B=1", "value": 0.5, "unit": "ms", "baseline": "hf",
                                  "baseline_value": 6.0, "ratio": 12.0}]
    assert len(record["load_average"]["start"]) == 3 and len(record["load_average"]["end"]) == 3
    assert record["machine"]["family"] == 23 and record["date"] and record["commit"]


def test_a_new_run_replaces_its_machine_kinds_record_and_keeps_the_others(tmp_path):
    write_record(tmp_path, ZEN1, [["1", "49152", "0.41", "6.36", "15.5×"]], date="2026-12-01T10:00:00+00:00")
    write_record(tmp_path, ZEN3, [["1", "49152", "0.30", "5.10", "17.0×"]], date="2026-12-01T11:00:00+00:00")
    write_record(tmp_path, ZEN1, [["1", "49152", "0.44", "6.20", "14.1×"]], date="2026-12-02T09:00:00+00:00")
    kinds = json.loads((tmp_path / "sampling.json").read_text())["tables"]["top_k"]
    assert sorted(kinds) == ["AuthenticAMD family 23 model 1", "AuthenticAMD family 25 model 1"]
    assert kinds["AuthenticAMD family 23 model 1"]["rows"] == [["1", "49152", "0.44", "6.20", "14.1×"]]
    # the current kind is the newest record's; the other kind is shown after it and says so
    now = render.current_kind(tmp_path)
    assert now == "AuthenticAMD family 23 model 1"
    out = render.render_text(PAGE, tmp_path, now)
    assert "0.41" not in out and out.index("0.44") < out.index("0.30")
    zen3_caption = [line for line in out.splitlines() if "AMD EPYC 7B13" in line][0]
    assert "**another machine kind** than the newest records' (AuthenticAMD family 23 model 1)" in zen3_caption
    zen1_caption = [line for line in out.splitlines() if "AMD EPYC 7551" in line][0]
    assert "another machine kind" not in zen1_caption


def test_a_current_block_shows_the_tables_newest_record_alone(tmp_path):
    write_record(tmp_path, ZEN3, [["1", "49152", "0.30", "5.10", "17.0×"]], date="2026-12-01T11:00:00+00:00")
    write_record(tmp_path, ZEN1, [["1", "49152", "0.44", "6.20", "14.1×"]], date="2026-12-02T09:00:00+00:00")
    page = PAGE.replace("<!-- results:sampling:top_k -->", "<!-- results:sampling:top_k:current -->")
    out = render.render_text(page, tmp_path, render.current_kind(tmp_path))
    assert "0.44" in out and "0.30" not in out and "AMD EPYC 7B13" not in out
    assert render.render_text(out, tmp_path, render.current_kind(tmp_path)) == out

def test_a_table_without_its_record_is_an_error(tmp_path):
    with pytest.raises(render.RenderError, match="no record for area 'sampling'"):
        render.render_text(PAGE, tmp_path, "any")
    write_record(tmp_path, ZEN1, [["1", "49152", "0.41", "6.36", "15.5×"]])
    with pytest.raises(render.RenderError, match="no record for table sampling:top_p"):
        render.render_text(PAGE.replace(":top_k", ":top_p"), tmp_path, "any")


def test_a_row_with_a_missing_cell_is_an_error(tmp_path):
    write_record(tmp_path, ZEN1, [["1", "49152", "0.41", "6.36", "15.5×"]])
    path = tmp_path / "sampling.json"
    data = json.loads(path.read_text())
    data["tables"]["top_k"]["AuthenticAMD family 23 model 1"]["rows"][0][3] = ""
    path.write_text(json.dumps(data))
    with pytest.raises(render.RenderError, match="row 1: a cell has no value"):
        render.render_text(PAGE, tmp_path, "any")


def test_a_recorder_refuses_a_row_that_does_not_fill_the_columns():
    t = records.Table("t", ["a", "b"])
    with pytest.raises(ValueError, match="a row of 1 cells for 2 columns"):
        t.row(["1"])
    with pytest.raises(ValueError, match="an empty cell"):
        t.row(["1", " "])
    with pytest.raises(ValueError, match="an empty cell"):
        t.row(["1", None])
    t.row(["1", "-"])
    assert t.rows == [["1", "-"]]


def test_an_unclosed_marker_is_an_error(tmp_path):
    with pytest.raises(render.RenderError, match="without its"):
        render.render_text("<!-- results:sampling:top_k -->\nno end\n", tmp_path, "any")


def test_a_timing_outside_the_blocks_is_unbacked_and_inside_is_not():
    text = ("decodes at 89.0 tok/s\n<!-- results:a:b -->\n| 12.5 ms | 1.08× |\n<!-- /results -->\n"
            "a 2.5× speed-up\n262,144 tokens, 671 MB, 256 rows, 10 s deadline\n")
    assert [n for n, _ in render.unbacked(text)] == [1, 5]


def test_render_all_reports_an_unbacked_figure_and_writes_nothing(tmp_path):
    (tmp_path / "docs").mkdir()
    (tmp_path / "README.md").write_text("# x\n\nIt runs at 50 tok/s.\n")
    with pytest.raises(render.RenderError, match=r"README.md:3: a timing no record backs"):
        render.render_all(root=tmp_path, folder=tmp_path / "results", now_kind="any")
    assert (tmp_path / "README.md").read_text() == "# x\n\nIt runs at 50 tok/s.\n"


def test_the_readme_and_docs_tables_are_the_records_rendered():
    """`make results` has been run since the last record: every block is current and no figure is unbacked."""
    for page in render.render_all():
        assert page.path.read_text() == page.text, f"{page.path.name}: run `make results`"


def test_a_record_taken_under_more_load_than_cores_says_so(tmp_path):
    rec = write_record(tmp_path, ZEN1, [["1", "49152", "0.41", "6.36", "15.5×"]])
    assert rec.load_start  # the record holds the load it ran under
    path = tmp_path / "sampling.json"
    data = json.loads(path.read_text())
    record = data["tables"]["top_k"]["AuthenticAMD family 23 model 1"]
    record["load_average"] = {"start": [1.5, 1.0, 1.0], "end": [1.9, 1.2, 1.0]}
    path.write_text(json.dumps(data))
    assert "load above" not in render.render_text(PAGE, tmp_path, "any")
    record["load_average"] = {"start": [1.5, 1.0, 1.0], "end": [6.9, 3.0, 1.0]}
    path.write_text(json.dumps(data))
    assert "load average 1.5 → 6.9 · **load above the 2 cores**" in render.render_text(PAGE, tmp_path, "any")
