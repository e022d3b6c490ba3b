BEGIN TRANSACTION;
CREATE TABLE answers (
    run_id TEXT NOT NULL REFERENCES runs(run_id),
    arm TEXT NOT NULL,
    repeat INTEGER NOT NULL,
    dataset TEXT NOT NULL,
    question_id TEXT NOT NULL,
    seed INTEGER NOT NULL,
    output TEXT NOT NULL,
    extracted TEXT,
    correct INTEGER NOT NULL,
    finish_reason TEXT,
    prompt_tokens INTEGER NOT NULL,
    completion_tokens INTEGER NOT NULL,
    latency_s REAL NOT NULL,
    num_drafts INTEGER,
    num_draft_tokens INTEGER,
    num_accepted_tokens INTEGER,
    num_forgiven_tokens INTEGER,
    source TEXT NOT NULL,
    created_at REAL NOT NULL,
    UNIQUE (run_id, arm, repeat, dataset, question_id)
);
INSERT INTO "answers" VALUES('judged-before-gold','baseline',0,'open','q0',0,'baseline answer 0',NULL,1,'stop',3,4,0.1,NULL,NULL,NULL,NULL,'',1.79662604929586386687e+09);
INSERT INTO "answers" VALUES('judged-before-gold','candidate',0,'open','q0',0,'candidate answer 0',NULL,0,'stop',3,4,0.1,NULL,NULL,NULL,NULL,'',1.79662604930153846742e+09);
INSERT INTO "answers" VALUES('judged-before-gold','baseline',0,'open','q1',1,'baseline answer 1',NULL,1,'stop',3,4,0.1,NULL,NULL,NULL,NULL,'',1.79662604930431509019e+09);
INSERT INTO "answers" VALUES('judged-before-gold','candidate',0,'open','q1',1,'candidate answer 1',NULL,1,'stop',3,4,0.1,NULL,NULL,NULL,NULL,'',1.79662604930951881401e+09);
INSERT INTO "answers" VALUES('judged-before-gold','baseline',0,'open','q2',2,'baseline answer 2',NULL,1,'stop',3,4,0.1,NULL,NULL,NULL,NULL,'',1.79662604931351351737e+09);
INSERT INTO "answers" VALUES('judged-before-gold','candidate',0,'open','q2',2,'candidate answer 2',NULL,1,'stop',3,4,0.1,NULL,NULL,NULL,NULL,'',1.79662604931702661516e+09);
INSERT INTO "answers" VALUES('judged-before-gold','baseline',0,'open','q3',3,'baseline answer 3',NULL,1,'stop',3,4,0.1,NULL,NULL,NULL,NULL,'',1.79662604931919622419e+09);
INSERT INTO "answers" VALUES('judged-before-gold','candidate',0,'open','q3',3,'candidate answer 3',NULL,1,'stop',3,4,0.1,NULL,NULL,NULL,NULL,'',1.79662604932149171828e+09);
CREATE TABLE batches (
    run_id TEXT NOT NULL REFERENCES runs(run_id),
    arm TEXT NOT NULL,
    repeat INTEGER NOT NULL,
    num_answers INTEGER NOT NULL,
    completion_tokens INTEGER NOT NULL,
    wall_s REAL NOT NULL,
    created_at REAL NOT NULL
);
CREATE TABLE events (
    run_id TEXT NOT NULL REFERENCES runs(run_id),
    event TEXT NOT NULL,
    reason TEXT,
    stopped_at INTEGER,
    detail TEXT NOT NULL,
    created_at REAL NOT NULL
);
CREATE TABLE judgements (
    run_id TEXT NOT NULL REFERENCES runs(run_id),
    dataset TEXT NOT NULL,
    question_id TEXT NOT NULL,
    first_lane TEXT NOT NULL,
    second_lane TEXT NOT NULL,
    position TEXT NOT NULL,
    pair_sha256 TEXT NOT NULL,
    verdict TEXT,
    preferred TEXT NOT NULL,
    output TEXT NOT NULL,
    latency_s REAL NOT NULL,
    source TEXT NOT NULL,
    created_at REAL NOT NULL,
    UNIQUE (run_id, dataset, question_id, first_lane, second_lane, position, pair_sha256)
);
CREATE TABLE labels (
    run_id TEXT NOT NULL REFERENCES runs(run_id),
    dataset TEXT NOT NULL,
    question_id TEXT NOT NULL,
    pair_sha256 TEXT NOT NULL,
    value INTEGER NOT NULL,
    source TEXT NOT NULL,
    detail TEXT NOT NULL,
    created_at REAL NOT NULL,
    UNIQUE (run_id, dataset, question_id)
);
CREATE TABLE questions (
    run_id TEXT NOT NULL REFERENCES runs(run_id),
    dataset TEXT NOT NULL,
    question_id TEXT NOT NULL,
    position INTEGER NOT NULL,
    prompt_hash TEXT NOT NULL,
    answer TEXT NOT NULL,
    grader TEXT NOT NULL,
    PRIMARY KEY (run_id, dataset, question_id)
);
INSERT INTO "questions" VALUES('judged-before-gold','open','q0',0,'hash0','','judge');
INSERT INTO "questions" VALUES('judged-before-gold','open','q1',1,'hash1','','judge');
INSERT INTO "questions" VALUES('judged-before-gold','open','q2',2,'hash2','','judge');
INSERT INTO "questions" VALUES('judged-before-gold','open','q3',3,'hash3','','judge');
CREATE TABLE runs (
    run_id TEXT PRIMARY KEY,
    kind TEXT NOT NULL,
    created_at REAL NOT NULL,
    margin REAL NOT NULL,
    alpha REAL NOT NULL,
    seed INTEGER NOT NULL,
    registration TEXT NOT NULL,
    notes TEXT NOT NULL
);
INSERT INTO "runs" VALUES('judged-before-gold','gate',1.79662604928568649291e+09,0.2,0.025,0,'{"alpha": 0.025, "arms": {"baseline": {"kind": "engine", "model": "m"}, "candidate": {"kind": "engine", "model": "m2"}}, "datasets": {"open": {"available": 4, "questions": 4, "sha256": "1111111111111111111111111111111111111111111111111111111111111111"}}, "design": "fixed", "judge": {"kind": "openai", "model": "judge-model", "positions": ["AB", "BA"], "rule": "both orders", "sampling": {"max_tokens": 64, "seed": 0, "temperature": 0.0}, "template": "pairwise-v1", "template_sha256": "0000000000000000000000000000000000000000000000000000000000000000", "template_text": "Which is better?"}, "limit": null, "margin": 0.2, "max_questions": null, "order": null, "repeats": [1, 1], "sampling": {"max_tokens": 16, "temperature": 0.0, "top_p": null}, "seed": 0, "shuffle_seed": null}','{}');
PRAGMA user_version=3;
COMMIT;
