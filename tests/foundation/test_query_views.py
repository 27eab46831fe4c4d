"""`regen query`: every view exists on every run, empty with the same columns when its files do not."""
from __future__ import annotations

import pyarrow as pa
import pytest

from regen.report.query import EMPTY, VIEWS, query, view_statements
from schemas.io import write_parquet_atomic
from schemas.rejected import REJECTED_SCHEMA


@pytest.mark.parametrize("view", list(VIEWS))
def test_every_view_exists_on_an_empty_run(tmp_path, view):
    cols, rows = query(tmp_path, f"SELECT * FROM {view}")
    assert rows == [] and cols
    excluded = {"prompt_token_ids", "completion_token_ids", "input_ids", "loss_spans"}
    assert cols == [n for n in EMPTY[view].names if n not in excluded]


def test_a_view_with_files_has_the_columns_of_its_empty_form(tmp_path):
    row = {n: None for n in REJECTED_SCHEMA.names}
    row.update(stage="select", filter="f", reason="r")
    write_parquet_atomic(pa.Table.from_pylist([row], schema=REJECTED_SCHEMA), tmp_path / "rejected/select/part-0.parquet",
                         REJECTED_SCHEMA)
    full_cols, rows = query(tmp_path, "SELECT * FROM rejected")
    assert len(rows) == 1
    (tmp_path / "rejected/select/part-0.parquet").unlink()
    empty_cols, rows = query(tmp_path, "SELECT * FROM rejected")
    assert rows == [] and empty_cols == full_cols
    # the views file for the DuckDB shell holds every view too
    assert len(view_statements(tmp_path)) == len(VIEWS)
    assert all(f"VIEW {v} AS" in (tmp_path / "views.sql").read_text() for v in VIEWS)


def test_joins_over_empty_views_work(tmp_path):
    cols, rows = query(tmp_path, "SELECT p.category, count(r.reason) FROM prompts p LEFT JOIN rejected r "
                                 "USING (prompt_id) GROUP BY 1")
    assert rows == []
