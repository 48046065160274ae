"""The host record's schema: its SQLite application id and the migrations, in order, that
bring a file from any older schema version to the newest (``user_version`` counts them)."""

from __future__ import annotations

APPLICATION_ID = 0x76735275  # "vsRu"


def _with_precision(table: str, columns: str, names: str, key: str) -> list[str]:
    """Statements that rebuild ``table`` with a ``precision`` column in its primary key (SQLite
    cannot alter a key), its rows kept as float32's."""
    scope = "fingerprint, revision, backend"
    return [f"""CREATE TABLE {table}_4 (fingerprint TEXT, revision TEXT, backend TEXT,
               precision TEXT NOT NULL DEFAULT 'float32', {columns},
               PRIMARY KEY ({scope}, precision{key}))""",
            f"INSERT INTO {table}_4 ({scope}, {names}) SELECT {scope}, {names} FROM {table}",
            f"DROP TABLE {table}",
            f"ALTER TABLE {table}_4 RENAME TO {table}"]


MIGRATIONS: list[list[str]] = [
    [  # 1: the base tables
        """CREATE TABLE hosts (fingerprint TEXT PRIMARY KEY, details TEXT NOT NULL,
           first_seen REAL NOT NULL)""",
        """CREATE TABLE workers (fingerprint TEXT, revision TEXT, backend TEXT,
           model TEXT NOT NULL, mode INTEGER NOT NULL, configured INTEGER NOT NULL,
           counts TEXT NOT NULL, updated_at REAL NOT NULL,
           PRIMARY KEY (fingerprint, revision, backend))""",
        """CREATE TABLE golden (fingerprint TEXT, revision TEXT, backend TEXT,
           digest TEXT NOT NULL, created_at REAL NOT NULL,
           PRIMARY KEY (fingerprint, revision, backend))""",
        """CREATE TABLE timings (fingerprint TEXT, revision TEXT, backend TEXT,
           size_lo INTEGER, num_threads INTEGER, samples_ms TEXT NOT NULL,
           updated_at REAL NOT NULL,
           PRIMARY KEY (fingerprint, revision, backend, size_lo, num_threads))""",
        """CREATE TABLE learned (fingerprint TEXT, revision TEXT, backend TEXT,
           size_lo INTEGER, num_threads INTEGER NOT NULL, speedup REAL NOT NULL,
           verified_passes INTEGER NOT NULL, updated_at REAL NOT NULL,
           PRIMARY KEY (fingerprint, revision, backend, size_lo))""",
        """CREATE TABLE vouchers (id INTEGER PRIMARY KEY, fingerprint TEXT, revision TEXT,
           backend TEXT, source TEXT NOT NULL, comparisons INTEGER NOT NULL,
           mismatches INTEGER NOT NULL, created_at REAL NOT NULL)""",
        """CREATE TABLE drift (id INTEGER PRIMARY KEY, fingerprint TEXT, revision TEXT,
           backend TEXT, padded_tokens INTEGER NOT NULL, served_threads INTEGER NOT NULL,
           shadow_threads INTEGER NOT NULL, first_index TEXT NOT NULL,
           served_value REAL NOT NULL, shadow_value REAL NOT NULL,
           created_at REAL NOT NULL, reset_at REAL)""",
    ],
    [  # 2: scope lookups by index
        "CREATE INDEX vouchers_scope ON vouchers (fingerprint, revision, backend)",
        "CREATE INDEX drift_scope ON drift (fingerprint, revision, backend)",
    ],
    [  # 3: what a sweep covered (counts, shape bounds); a reset retires vouchers; who drifted
        "ALTER TABLE vouchers ADD COLUMN coverage TEXT",  # JSON ``Coverage``; NULL: none
        "ALTER TABLE vouchers ADD COLUMN reset_at REAL",
        "ALTER TABLE drift ADD COLUMN rows INTEGER",
        "ALTER TABLE drift ADD COLUMN worker TEXT",
    ],
    [  # 4: the scope gains the precision (R1.5); rows from before are float32's
        *_with_precision("workers", """model TEXT NOT NULL, mode INTEGER NOT NULL,
           configured INTEGER NOT NULL, counts TEXT NOT NULL, updated_at REAL NOT NULL""",
                         "model, mode, configured, counts, updated_at", ""),
        *_with_precision("golden", "digest TEXT NOT NULL, created_at REAL NOT NULL",
                         "digest, created_at", ""),
        *_with_precision("timings", """size_lo INTEGER, num_threads INTEGER,
           samples_ms TEXT NOT NULL, updated_at REAL NOT NULL""",
                         "size_lo, num_threads, samples_ms, updated_at",
                         ", size_lo, num_threads"),
        *_with_precision("learned", """size_lo INTEGER, num_threads INTEGER NOT NULL,
           speedup REAL NOT NULL, verified_passes INTEGER NOT NULL, updated_at REAL NOT NULL""",
                         "size_lo, num_threads, speedup, verified_passes, updated_at",
                         ", size_lo"),
        "ALTER TABLE vouchers ADD COLUMN precision TEXT NOT NULL DEFAULT 'float32'",
        "ALTER TABLE drift ADD COLUMN precision TEXT NOT NULL DEFAULT 'float32'",
        "DROP INDEX vouchers_scope",
        "DROP INDEX drift_scope",
        "CREATE INDEX vouchers_scope ON vouchers (fingerprint, revision, backend, precision)",
        "CREATE INDEX drift_scope ON drift (fingerprint, revision, backend, precision)",
    ],
    [  # 5: shapes verified one by one (traffic's shadows, bounded sweeps), per configured count
        """CREATE TABLE verified_shapes (fingerprint TEXT, revision TEXT, backend TEXT,
           precision TEXT, configured INTEGER, rows INTEGER, length INTEGER,
           num_threads INTEGER, comparisons INTEGER NOT NULL, mismatches INTEGER NOT NULL,
           source TEXT NOT NULL, updated_at REAL NOT NULL,
           PRIMARY KEY (fingerprint, revision, backend, precision, configured, rows, length,
                        num_threads))""",
    ],
    [  # 6: who wrote a learned count (one row per writer) and which writers are live (R4.12)
        """CREATE TABLE learned_6 (fingerprint TEXT, revision TEXT, backend TEXT,
           precision TEXT, size_lo INTEGER, writer TEXT NOT NULL DEFAULT '',
           num_threads INTEGER NOT NULL, speedup REAL NOT NULL,
           verified_passes INTEGER NOT NULL, updated_at REAL NOT NULL,
           origin TEXT,  -- 'own' samples or a 'sibling' writer's count; NULL: not recorded
           PRIMARY KEY (fingerprint, revision, backend, precision, size_lo, writer))""",
        # rows from before have no writer ('' is no live writer's id)
        """INSERT INTO learned_6 (fingerprint, revision, backend, precision, size_lo,
           num_threads, speedup, verified_passes, updated_at)
           SELECT fingerprint, revision, backend, precision, size_lo, num_threads, speedup,
           verified_passes, updated_at FROM learned""",
        "DROP TABLE learned",
        "ALTER TABLE learned_6 RENAME TO learned",
        """CREATE TABLE writers (writer TEXT PRIMARY KEY, fingerprint TEXT NOT NULL,
           revision TEXT NOT NULL, backend TEXT NOT NULL, precision TEXT NOT NULL,
           pid INTEGER NOT NULL, started_at REAL NOT NULL, seen_at REAL NOT NULL)""",
    ],
]
SCHEMA_VERSION = len(MIGRATIONS)
