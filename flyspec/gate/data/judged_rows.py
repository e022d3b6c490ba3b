"""The gate store's judge calls and gold labels: a judged run's ``judgements``, ``labels`` and
``second_labels`` tables (``GateStore`` holds these methods; flyspec/gate/data/store.py opens the file).

Like answers, these rows are only ever added: a judge call is stored once per pair of outputs and position,
a gold label once per question (never replaced), a second person's label once per labeller.
"""

from __future__ import annotations

import json
import sqlite3
import time
from dataclasses import asdict

from flyspec.gate.data.records import JudgementRecord, LabelRecord


class JudgedRows:
    """The judged part of ``GateStore``: what the judge said of each pair, and each pair's labels."""

    _db: sqlite3.Connection

    def add_judgement(self, run_id: str, record: JudgementRecord) -> bool:
        """Commit one judge call now; False (and nothing written) if that judgement is already stored."""
        row = asdict(record)
        columns = ["run_id", *row.keys(), "created_at"]
        with self._db:
            cursor = self._db.execute(
                f"INSERT INTO judgements ({', '.join(columns)}) VALUES ({', '.join('?' * len(columns))}) "
                "ON CONFLICT DO NOTHING",
                [run_id, *row.values(), time.time()],
            )
        return cursor.rowcount == 1

    def judgements(self, run_id: str) -> list[JudgementRecord]:
        """Every stored judge call of a run, oldest first."""
        names = list(JudgementRecord.__dataclass_fields__)
        rows = self._db.execute(
            f"SELECT {', '.join(names)} FROM judgements WHERE run_id = ? ORDER BY created_at, rowid",
            (run_id,),
        )
        return [JudgementRecord(*row) for row in rows]

    def add_label(self, run_id: str, record: LabelRecord) -> bool:
        """Commit a gold label; False (nothing written) when the question already has one: a label, once
        given, is never replaced."""
        with self._db:
            cursor = self._db.execute(
                "INSERT INTO labels VALUES (?, ?, ?, ?, ?, ?, ?, ?) "
                "ON CONFLICT (run_id, dataset, question_id) DO NOTHING",
                (
                    run_id,
                    record.dataset,
                    record.question_id,
                    record.pair_sha256,
                    int(record.value),
                    record.source,
                    json.dumps(record.detail, sort_keys=True),
                    time.time(),
                ),
            )
        return cursor.rowcount == 1

    def labels(self, run_id: str) -> dict[tuple[str, str], LabelRecord]:
        """Every gold label of a run, by ``(dataset, question_id)``."""
        rows = self._db.execute(
            "SELECT dataset, question_id, pair_sha256, value, source, detail FROM labels WHERE run_id = ?",
            (run_id,),
        )
        return {(d, q): LabelRecord(d, q, h, v, s, json.loads(t)) for d, q, h, v, s, t in rows}

    def add_second_label(self, run_id: str, labeller: str, record: LabelRecord) -> bool:
        """Commit a second person's label of a pair that has its gold label (agreement between labellers;
        never part of the decision); False (nothing written) when ``labeller`` already labelled it."""
        with self._db:
            cursor = self._db.execute(
                "INSERT INTO second_labels VALUES (?, ?, ?, ?, ?, ?, ?, ?) ON CONFLICT DO NOTHING",
                (
                    run_id,
                    record.dataset,
                    record.question_id,
                    labeller,
                    record.pair_sha256,
                    int(record.value),
                    json.dumps(record.detail, sort_keys=True),
                    time.time(),
                ),
            )
        return cursor.rowcount == 1

    def second_labels(self, run_id: str) -> list[LabelRecord]:
        """Every second label of a run, oldest first (the labeller is in each record's ``detail``)."""
        rows = self._db.execute(
            "SELECT dataset, question_id, pair_sha256, value, detail FROM second_labels WHERE run_id = ? "
            "ORDER BY created_at, rowid",
            (run_id,),
        )
        return [LabelRecord(d, q, h, v, "human", json.loads(t)) for d, q, h, v, t in rows]
