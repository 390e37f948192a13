-- 第七篇：没有重复执行，为什么还是办错了？ PostgreSQL 版。
-- Article 7: no duplicate execution, yet still wrong.  The PostgreSQL edition.
--
-- 载入 Load: psql -v ON_ERROR_STOP=1 -f article7.sql   (again is safe: every row stays)
-- Everything lives in the schema article7, which must be the loading role's; the load pins its
-- own search_path, and every function sets its own, so a caller's path (a temporary table,
-- article1 first, another role's schema) never changes what runs or what it reads.
-- 调用 Call: SELECT article7.execute('job-1', '{"src": "A", "dst": "B", "amount": 3,
--            "expected": {"A": 1, "B": 1}}', 0, 0);
-- A plan goes in as JSON text, so that 3.0 and 1e3 reach the function as written (floats,
-- refused as amounts, as Python refuses them); every function returns a jsonb object with a
-- "status"; malformed input raises 22023 and stores nothing.
-- Seed the resources first: INSERT INTO article7.resources VALUES ('A', 10, 1), ('B', 0, 1);
-- Retry rules and what to do after a lost COMMIT: README.md beside this file.

BEGIN;

-- The load's own search_path, as pg_dump's output pins it: empty, so that only pg_catalog is
-- searched, and no schema or function of another role named in the loading session's path
-- (by the role, the database or PGOPTIONS) runs with the loading role's rights; everything
-- below names its schema.  SET LOCAL ends with this transaction, and looks nothing up.
SET LOCAL search_path = '';

-- The canonical form below writes UTF-8 text: a database of another encoding is refused.
DO $$
BEGIN
    IF pg_catalog.current_setting('server_encoding') <> 'UTF8' THEN
        RAISE EXCEPTION 'article7 needs a UTF8 database, not %',
            pg_catalog.current_setting('server_encoding');
    END IF;
END $$;

-- Only for this load: a second load does not list what it keeps.
SET LOCAL client_min_messages = warning;
CREATE SCHEMA IF NOT EXISTS article7;
-- A schema of this name that another role made first would be theirs, and so would every
-- function loaded into it: they could replace one, and the loading role's next call would
-- run their code with its rights.  So the schema must be the loading role's, with nothing in
-- it of another role's, and no other role may create in it.  A trigger runs its function with
-- the rights of whoever writes the table: this load's own writes below, and every later call.
-- So no trigger on our tables may run, or test in its WHEN condition, a function another role
-- owns (that role could replace it), checked here before this file writes a row; pg_catalog's
-- are exempt: only a superuser changes them, who can change ours too.  Who may make such a
-- trigger is checked once every table exists, below.
DO $$
DECLARE
    v_owner oid;
    v_others text;
BEGIN
    SELECT nspowner INTO v_owner FROM pg_catalog.pg_namespace WHERE nspname = 'article7';
    IF v_owner <> (SELECT oid FROM pg_catalog.pg_roles WHERE rolname = current_user) THEN
        RAISE EXCEPTION 'schema article7 belongs to %, not to %, who loads this file',
            pg_catalog.pg_get_userbyid(v_owner), current_user
            USING HINT = 'Drop or rename that schema, or load this file as its owner.';
    END IF;
    SELECT pg_catalog.string_agg(pg_catalog.format('%s %s of %s', o.type, o.identity,
                                                   pg_catalog.pg_get_userbyid(d.refobjid)),
                                 ', ' ORDER BY o.identity)
      INTO v_others
      FROM pg_catalog.pg_shdepend d,
           LATERAL pg_catalog.pg_identify_object(d.classid, d.objid, d.objsubid) o
     WHERE d.deptype = 'o' AND o.schema = 'article7' AND d.refobjid <> v_owner
       AND d.dbid = (SELECT oid FROM pg_catalog.pg_database
                      WHERE datname = pg_catalog.current_database());
    IF v_others IS NOT NULL THEN
        RAISE EXCEPTION 'schema article7 holds what another role owns: %', v_others;
    END IF;
    SELECT pg_catalog.string_agg(CASE a.grantee WHEN 0 THEN 'PUBLIC'
                                 ELSE pg_catalog.pg_get_userbyid(a.grantee) END, ', ')
      INTO v_others
      FROM pg_catalog.pg_namespace n, LATERAL pg_catalog.aclexplode(n.nspacl) a
     WHERE n.nspname = 'article7' AND a.privilege_type = 'CREATE' AND a.grantee <> n.nspowner;
    IF v_others IS NOT NULL THEN
        RAISE EXCEPTION 'schema article7 lets % create in it', v_others;
    END IF;
    SELECT pg_catalog.string_agg(pg_catalog.format('trigger %s on %s runs %s of %s', t.tgname,
                                                   t.tgrelid::pg_catalog.regclass,
                                                   p.oid::pg_catalog.regprocedure,
                                                   pg_catalog.pg_get_userbyid(p.proowner)),
                                 ', ' ORDER BY c.relname, t.tgname, p.oid)
      INTO v_others
      FROM pg_catalog.pg_trigger t
      JOIN pg_catalog.pg_class c ON c.oid = t.tgrelid,
           -- The trigger's function, and what its WHEN condition calls: functions, and the
           -- functions behind its operators (pg_depend records both).
           LATERAL (SELECT t.tgfoid
                     UNION SELECT d.refobjid FROM pg_catalog.pg_depend d
                      WHERE d.classid = 'pg_catalog.pg_trigger'::pg_catalog.regclass
                        AND d.objid = t.oid
                        AND d.refclassid = 'pg_catalog.pg_proc'::pg_catalog.regclass
                     UNION SELECT o.oprcode::pg_catalog.oid FROM pg_catalog.pg_depend d
                      JOIN pg_catalog.pg_operator o ON o.oid = d.refobjid
                      WHERE d.classid = 'pg_catalog.pg_trigger'::pg_catalog.regclass
                        AND d.objid = t.oid
                        AND d.refclassid = 'pg_catalog.pg_operator'::pg_catalog.regclass) f(oid)
      JOIN pg_catalog.pg_proc p ON p.oid = f.oid
     WHERE c.relnamespace = 'article7'::pg_catalog.regnamespace AND NOT t.tgisinternal
       AND p.proowner <> v_owner
       AND p.pronamespace <> 'pg_catalog'::pg_catalog.regnamespace;
    IF v_others IS NOT NULL THEN
        RAISE EXCEPTION 'article7''s tables have triggers that run another role''s code: %',
            v_others USING HINT = 'Drop those triggers, or load this file as that role.';
    END IF;
END $$;

-- Tables are created only when missing, so a second load keeps the rows.  A later edition
-- whose tables differ says here how to upgrade; this file refuses a schema of another one.
CREATE TABLE IF NOT EXISTS article7.edition (
    id integer PRIMARY KEY CHECK (id = 1),
    version integer NOT NULL);
INSERT INTO article7.edition VALUES (1, 1) ON CONFLICT DO NOTHING;
DO $$
BEGIN
    IF (SELECT version FROM article7.edition) <> 1 THEN
        RAISE EXCEPTION 'article7 holds edition %, this file is edition 1',
            (SELECT version FROM article7.edition);
    END IF;
END $$;


-- === 第七篇 §1: resources carry revisions; receipts, effects and changes =================
-- Every write that goes through execute() or change() raises the revision by one.
CREATE TABLE IF NOT EXISTS article7.resources (
    name text PRIMARY KEY CHECK (length(name) BETWEEN 1 AND 64),
    quantity bigint NOT NULL CHECK (quantity >= 0),
    revision bigint NOT NULL CHECK (revision >= 1));
-- §2, §5: one terminal receipt per op, rejections included, never modified once committed.
CREATE TABLE IF NOT EXISTS article7.receipt (
    op text PRIMARY KEY,
    digest text NOT NULL,
    result jsonb NOT NULL,
    tick bigint NOT NULL);
CREATE INDEX IF NOT EXISTS receipt_by_tick ON article7.receipt (tick);
-- At most one effect per transfer op, one row per applied change(): they outlive receipts.
CREATE TABLE IF NOT EXISTS article7.effects (
    op text PRIMARY KEY,
    src text NOT NULL,
    dst text NOT NULL,
    amount bigint NOT NULL);
CREATE TABLE IF NOT EXISTS article7.changes (
    op text PRIMARY KEY,
    name text NOT NULL,
    delta bigint NOT NULL,
    revision bigint NOT NULL);
-- Beyond 第七篇: receipts written before low_water may be gone, so an op issued before it that
-- finds no receipt is refused.  One row, locked by every execute(), change() and purge().
CREATE TABLE IF NOT EXISTS article7.retention (
    id integer PRIMARY KEY CHECK (id = 1),
    low_water bigint NOT NULL CHECK (low_water >= 0));
INSERT INTO article7.retention VALUES (1, 0) ON CONFLICT DO NOTHING;

-- Who may make a trigger on our tables: CREATE TRIGGER takes the TRIGGER privilege on the
-- table (GRANT ALL includes it) and EXECUTE on the function, so no other role, PUBLIC
-- included, may hold TRIGGER on them.  Checked now that every table exists, so that a
-- privilege that default privileges (ALTER DEFAULT PRIVILEGES) gave a table made by this load
-- is refused too; refused, this transaction makes and changes nothing.
DO $$
DECLARE
    v_others text;
BEGIN
    SELECT pg_catalog.string_agg(pg_catalog.format('%s on %s', g.grantee, g.tables), '; '
                                 ORDER BY g.grantee COLLATE pg_catalog."C")
      INTO v_others
      FROM (SELECT CASE a.grantee WHEN 0 THEN 'PUBLIC'
                   ELSE pg_catalog.pg_get_userbyid(a.grantee) END AS grantee,
                   pg_catalog.string_agg(c.oid::pg_catalog.regclass::text, ', '
                                         ORDER BY c.relname) AS tables
              FROM pg_catalog.pg_class c, LATERAL pg_catalog.aclexplode(c.relacl) a
             WHERE c.relnamespace = 'article7'::pg_catalog.regnamespace
               AND a.privilege_type = 'TRIGGER' AND a.grantee <> c.relowner
             GROUP BY a.grantee) g;
    IF v_others IS NOT NULL THEN
        RAISE EXCEPTION 'article7''s tables let other roles create triggers on them: %', v_others
            USING HINT = 'REVOKE TRIGGER ON ALL TABLES IN SCHEMA article7 FROM those roles.';
    END IF;
END $$;


-- === 第七篇 §2–§6: execute, a version-checked transfer, decided once ========================
-- 先以共享锁读低水位，再按名字顺序锁两行，然后先查回执（历史），再查版本与余额（现在）。
-- Returns what preconditions.execute returns.  Decided and stored as the op's receipt:
-- {"status": "applied", "revisions", "quantities"}, "missing_resource" with "missing",
-- "stale" with "observed", "insufficient" with "available", "overflow" with "resource" and
-- "column".  Not stored: {"status": "replayed", "result": the stored one}, "conflict" (the op
-- was decided for another command), "expired" with "low_water" (no receipt, issued before
-- the mark or with its effect still there: decided before its receipt was purged).
CREATE OR REPLACE FUNCTION article7.execute(p_op text, p_command text, p_issued_at numeric,
                                            p_now numeric) RETURNS jsonb
LANGUAGE plpgsql SET search_path = article7, pg_temp AS $$
DECLARE
    v_text text;
    v_command json;
    v_src text;
    v_dst text;
    v_amount bigint;
    v_low_water bigint;
    v_result jsonb;
    s resources%ROWTYPE;
    d resources%ROWTYPE;
BEGIN
    v_text := validate(p_op, p_command);
    PERFORM check_ticks(p_issued_at, p_now);
    v_command := v_text::json;
    v_src := v_command ->> 'src';
    v_dst := v_command ->> 'dst';
    v_amount := v_command ->> 'amount';
    -- The mark first, in share mode, as in article 1: a purge in flight is waited for, and
    -- none starts before this call ends, so no receipt of this op vanishes while it decides.
    SELECT low_water INTO v_low_water FROM retention FOR SHARE;
    -- §3: both rows locked, in name order, by one statement: plans on them queue here, and
    -- never deadlock.  At REPEATABLE READ a row changed since the snapshot raises 40001.
    PERFORM 1 FROM resources WHERE name IN (v_src, v_dst) ORDER BY name FOR UPDATE;
    -- §2: history before the present.
    v_result := history(p_op, digest_of(v_text), p_issued_at, v_low_water);
    IF v_result IS NOT NULL THEN
        RETURN v_result;
    END IF;
    SELECT * INTO s FROM resources WHERE name = v_src;
    SELECT * INTO d FROM resources WHERE name = v_dst;
    IF s.name IS NULL OR d.name IS NULL THEN
        v_result := jsonb_build_object('status', 'missing_resource', 'missing', ARRAY(
            SELECT m FROM unnest(ARRAY[v_src, v_dst]) AS m
             WHERE m IS DISTINCT FROM s.name AND m IS DISTINCT FROM d.name
             ORDER BY m COLLATE "C"));
    ELSIF s.revision <> (v_command -> 'expected' ->> v_src)::bigint
          OR d.revision <> (v_command -> 'expected' ->> v_dst)::bigint THEN
        v_result := jsonb_build_object('status', 'stale', 'observed',
                                       jsonb_build_object(v_src, s.revision, v_dst, d.revision));
    ELSIF s.quantity < v_amount THEN
        v_result := jsonb_build_object('status', 'insufficient', 'available', s.quantity);
    -- §4: refused at the bound, never wrapped.
    ELSIF s.revision = 9223372036854775807 OR d.revision = 9223372036854775807 THEN
        v_result := jsonb_build_object('status', 'overflow', 'column', 'revision', 'resource',
            CASE WHEN s.revision = 9223372036854775807 THEN v_src ELSE v_dst END);
    ELSIF d.quantity > 9223372036854775807 - v_amount THEN
        v_result := jsonb_build_object('status', 'overflow', 'column', 'quantity',
                                       'resource', v_dst);
    ELSE
        UPDATE resources SET quantity = s.quantity - v_amount, revision = s.revision + 1
         WHERE name = v_src;
        UPDATE resources SET quantity = d.quantity + v_amount, revision = d.revision + 1
         WHERE name = v_dst;
        INSERT INTO effects VALUES (p_op, v_src, v_dst, v_amount);
        v_result := jsonb_build_object(
            'status', 'applied',
            'revisions', jsonb_build_object(v_src, s.revision + 1, v_dst, d.revision + 1),
            'quantities', jsonb_build_object(v_src, s.quantity - v_amount,
                                             v_dst, d.quantity + v_amount));
    END IF;
    -- §5: the receipt, rejections included.  A plain INSERT: a racing call of this op for
    -- other rows that committed first raises 23505 here, and the retry answers conflict.
    INSERT INTO receipt VALUES (p_op, digest_of(v_text), v_result, p_now);
    RETURN v_result;
END $$;

-- 另一种业务写入：数量加 delta、版本加一，每个操作 ID 一次，回执同在一个事务里。
-- §4: the other business write: quantity + delta and revision + 1, once per op, with its
-- receipt.  Decided and stored: {"status": "changed", "name", "quantity", "revision"},
-- "missing_resource", "insufficient" (the quantity would go below zero), "overflow"; not
-- stored: "replayed", "conflict", "expired", as execute() answers them.
CREATE OR REPLACE FUNCTION article7.change(p_op text, p_name text, p_delta numeric,
                                           p_issued_at numeric, p_now numeric) RETURNS jsonb
LANGUAGE plpgsql SET search_path = article7, pg_temp AS $$
DECLARE
    v_digest text;
    v_low_water bigint;
    v_result jsonb;
    r resources%ROWTYPE;
BEGIN
    PERFORM check_text(p_op, 'op', 128);
    PERFORM check_text(p_name, 'name', 64);
    IF NOT coalesce(scale(p_delta) = 0 AND abs(p_delta) <= 9223372036854775807, false) THEN
        RAISE EXCEPTION 'delta must be an integer from -(2^63 - 1) to 2^63 - 1'
            USING ERRCODE = '22023';
    END IF;
    PERFORM check_ticks(p_issued_at, p_now);
    -- The digest of preconditions.change's command, {"change": name, "delta": delta}, as
    -- json.dumps writes it: to_json escapes a name as json.dumps does.
    v_digest := digest_of('{"change":' || to_json(p_name)::text || ',"delta":' || p_delta || '}');
    -- The mark, then the row, then history, in the order execute() takes them.
    SELECT low_water INTO v_low_water FROM retention FOR SHARE;
    SELECT * INTO r FROM resources WHERE name = p_name FOR UPDATE;
    v_result := history(p_op, v_digest, p_issued_at, v_low_water);
    IF v_result IS NOT NULL THEN
        RETURN v_result;
    END IF;
    IF r.name IS NULL THEN
        v_result := jsonb_build_object('status', 'missing_resource',
                                       'missing', jsonb_build_array(p_name));
    ELSIF r.quantity + p_delta < 0 THEN
        v_result := jsonb_build_object('status', 'insufficient', 'available', r.quantity);
    ELSIF r.quantity + p_delta > 9223372036854775807 OR r.revision = 9223372036854775807 THEN
        v_result := jsonb_build_object('status', 'overflow', 'resource', p_name, 'column',
            CASE WHEN r.revision = 9223372036854775807 THEN 'revision' ELSE 'quantity' END);
    ELSE
        UPDATE resources SET quantity = r.quantity + p_delta, revision = r.revision + 1
         WHERE name = p_name;
        INSERT INTO changes VALUES (p_op, p_name, p_delta, r.revision + 1);
        v_result := jsonb_build_object('status', 'changed', 'name', p_name,
                                       'quantity', r.quantity + p_delta,
                                       'revision', r.revision + 1);
    END IF;
    INSERT INTO receipt VALUES (p_op, v_digest, v_result, p_now);
    RETURN v_result;
END $$;

-- §2: the receipt's answer for op, or NULL for a new op.  Read in one statement, one snapshot:
-- a racing call of the op that commits meanwhile is either seen whole or not at all (then
-- its receipt raises 23505 at this call's INSERT).
CREATE OR REPLACE FUNCTION article7.history(p_op text, p_digest text, p_issued_at numeric,
                                            p_low_water bigint) RETURNS jsonb
LANGUAGE plpgsql SET search_path = article7, pg_temp AS $$
DECLARE
    v_old receipt%ROWTYPE;
    v_acted boolean;
BEGIN
    SELECT h.*, EXISTS (SELECT 1 FROM effects WHERE op = p_op)
                OR EXISTS (SELECT 1 FROM changes WHERE op = p_op)
      INTO v_old.op, v_old.digest, v_old.result, v_old.tick, v_acted
      FROM (VALUES (1)) AS one LEFT JOIN receipt h ON h.op = p_op;
    IF v_old.op IS NOT NULL THEN
        IF v_old.digest <> p_digest THEN
            RETURN '{"status": "conflict"}';
        END IF;
        RETURN jsonb_build_object('status', 'replayed', 'result', v_old.result);
    END IF;
    -- No receipt, but perhaps a purged one: an op issued before the mark, or one whose
    -- effect or change outlives its receipt, was decided already.
    IF p_issued_at < p_low_water OR v_acted THEN
        RETURN jsonb_build_object('status', 'expired', 'low_water', p_low_water);
    END IF;
    RETURN NULL;
END $$;


-- === beyond 第七篇: receipts are not kept forever ==========================================
-- 删除 now - window 之前写下的回执并抬高低水位；效果与变更永远留着，正好在低水位的回执也留着。
-- As in article 1: deletes the receipts written before p_now - p_window and raises the mark
-- to it: {"status": "purged", "deleted", "low_water"}, or {"status": "backwards", "low_water"}
-- (nothing changed).  A receipt written at the mark stays; effects and changes always stay.
CREATE OR REPLACE FUNCTION article7.purge(p_now numeric, p_window numeric) RETURNS jsonb
LANGUAGE plpgsql SET search_path = article7, pg_temp AS $$
DECLARE
    v_mark bigint;
    v_low_water bigint;
    v_deleted bigint;
BEGIN
    PERFORM check_ticks(0, p_now);
    IF NOT coalesce(scale(p_window) = 0 AND p_window BETWEEN 1 AND 4611686018427387904
                    AND p_now - p_window >= 0, false) THEN
        RAISE EXCEPTION 'window must be an integer from 1 to now (%), not %', p_now, p_window
            USING ERRCODE = '22023';
    END IF;
    v_mark := p_now - p_window;
    -- Locked first: purges queue here, and execute() and change() calls in flight are waited
    -- for.
    SELECT low_water INTO v_low_water FROM retention FOR UPDATE;
    IF v_mark < v_low_water THEN
        RETURN jsonb_build_object('status', 'backwards', 'low_water', v_low_water);
    END IF;
    DELETE FROM receipt WHERE tick < v_mark;
    GET DIAGNOSTICS v_deleted = ROW_COUNT;
    UPDATE retention SET low_water = v_mark;
    RETURN jsonb_build_object('status', 'purged', 'deleted', v_deleted, 'low_water', v_mark);
END $$;


-- === helpers: input checks (22023 before anything is written) ==============================
CREATE OR REPLACE FUNCTION article7.check_text(p_value text, p_what text, p_limit integer)
RETURNS text
LANGUAGE plpgsql IMMUTABLE SET search_path = article7, pg_temp AS $$
BEGIN
    IF NOT coalesce(length(p_value) BETWEEN 1 AND p_limit, false) THEN
        RAISE EXCEPTION '% must have 1 to % characters', p_what, p_limit USING ERRCODE = '22023';
    END IF;
    RETURN p_value;
END $$;

-- §2: a fixed structure, two different names of 1 to 64 characters, an integer amount from 1
-- to 10^15 and integer revisions from 1 (3.0 and 1e3 are floats, as Python reads them; true
-- is no integer).  Returns the command's canonical text, whose digest is the receipt's.
CREATE OR REPLACE FUNCTION article7.validate(p_op text, p_command text) RETURNS text
LANGUAGE plpgsql IMMUTABLE SET search_path = article7, pg_temp AS $$
DECLARE
    v_text text;
    v json;
    v_src text;
    v_dst text;
BEGIN
    PERFORM check_text(p_op, 'op', 128);
    v_text := canonical(p_command);
    -- json, not jsonb: each number keeps its canonical lexeme, 1000.0 apart from 1000.
    v := v_text::json;
    IF ARRAY(SELECT k FROM json_object_keys(v) AS k ORDER BY k COLLATE "C")
       <> ARRAY['amount', 'dst', 'expected', 'src'] THEN
        RAISE EXCEPTION 'command keys must be exactly amount, dst, expected, src'
            USING ERRCODE = '22023';
    END IF;
    v_src := json_text(v -> 'src', 'src');
    v_dst := json_text(v -> 'dst', 'dst');
    IF v_src = v_dst THEN
        RAISE EXCEPTION 'src and dst must be different resources' USING ERRCODE = '22023';
    END IF;
    PERFORM json_int(v -> 'amount', 'amount', 1, 1000000000000000);
    IF json_typeof(v -> 'expected') <> 'object'
       OR ARRAY(SELECT k FROM json_object_keys(v -> 'expected') AS k ORDER BY k COLLATE "C")
          <> ARRAY(SELECT k FROM unnest(ARRAY[v_src, v_dst]) AS k ORDER BY k COLLATE "C") THEN
        RAISE EXCEPTION 'expected must name exactly src and dst' USING ERRCODE = '22023';
    END IF;
    PERFORM json_int(v -> 'expected' -> v_src, 'expected src', 1, 9223372036854775807);
    PERFORM json_int(v -> 'expected' -> v_dst, 'expected dst', 1, 9223372036854775807);
    RETURN v_text;
EXCEPTION WHEN untranslatable_character THEN
    -- A \u0000 in a name: Python accepts it, PostgreSQL text cannot hold it.
    RAISE EXCEPTION 'a name or key holds \u0000, which PostgreSQL text cannot hold'
        USING ERRCODE = '22023';
END $$;

CREATE OR REPLACE FUNCTION article7.json_text(p_value json, p_what text) RETURNS text
LANGUAGE plpgsql IMMUTABLE SET search_path = article7, pg_temp AS $$
BEGIN
    IF json_typeof(p_value) IS DISTINCT FROM 'string' THEN
        RAISE EXCEPTION '% must be a string', p_what USING ERRCODE = '22023';
    END IF;
    RETURN check_text(p_value #>> '{}', p_what, 64);
END $$;

CREATE OR REPLACE FUNCTION article7.json_int(p_value json, p_what text, p_low numeric,
                                             p_high numeric) RETURNS void
LANGUAGE plpgsql IMMUTABLE SET search_path = article7, pg_temp AS $$
BEGIN
    IF NOT coalesce(json_typeof(p_value) = 'number' AND p_value::text ~ '^-?[0-9]+$'
                    AND p_value::text::numeric BETWEEN p_low AND p_high, false) THEN
        RAISE EXCEPTION '% must be an integer from % to %', p_what, p_low, p_high
            USING ERRCODE = '22023';
    END IF;
END $$;


-- === twins: identical in article7.sql and article7.sql (a test compares them) ==============
-- 规范文本与摘要：与 reliability.canonical 和 preconditions 的摘要逐字节相同。
-- Logical ticks are integers from 0 to 2^62, and nothing is acted on before it was issued.
CREATE OR REPLACE FUNCTION article7.check_ticks(p_issued_at numeric, p_now numeric) RETURNS void
LANGUAGE plpgsql IMMUTABLE SET search_path = article7, pg_temp AS $$
BEGIN
    IF NOT coalesce(scale(p_issued_at) = 0 AND scale(p_now) = 0 AND 0 <= p_issued_at
                    AND p_issued_at <= p_now AND p_now <= 4611686018427387904, false) THEN
        RAISE EXCEPTION 'ticks need integers 0 <= issued_at (%) <= now (%) <= 2^62',
            p_issued_at, p_now USING ERRCODE = '22023';
    END IF;
END $$;

-- The SHA-256 of a text's UTF-8 bytes, in hex: reliability.canonical's and preconditions'.
CREATE OR REPLACE FUNCTION article7.digest_of(p_text text) RETURNS text
LANGUAGE sql IMMUTABLE SET search_path = article7, pg_temp AS $$
    SELECT encode(sha256(convert_to(p_text, 'UTF8')), 'hex')
$$;

-- The canonical text of a JSON object, as reliability.canonical writes it: Python's json.dumps
-- with sorted keys, separators (",", ":"), ensure_ascii=False.  At most 32 levels (a scalar
-- counts) and 65536 bytes; a repeated key, NaN or an infinite number raises 22023.
CREATE OR REPLACE FUNCTION article7.canonical(p_json text) RETURNS text
LANGUAGE plpgsql IMMUTABLE SET search_path = article7, pg_temp AS $$
DECLARE
    v_text text := canonical_json(p_json);
BEGIN
    IF left(v_text, 1) <> '{' THEN
        RAISE EXCEPTION 'a payload is a JSON object' USING ERRCODE = '22023';
    END IF;
    RETURN v_text;
END $$;

-- Any JSON value, walked token by token: PostgreSQL's json_each would decode keys, and cannot
-- hold the \u0000 that Python accepts; jsonb would forget how each number was written.
CREATE OR REPLACE FUNCTION article7.canonical_json(p_json text) RETURNS text
LANGUAGE plpgsql IMMUTABLE SET search_path = article7, pg_temp
SET standard_conforming_strings = on AS $$
DECLARE
    v_token text;
    v_value text;
    -- In an object: the canonical key whose value comes next, and its sort order.
    v_key text;
    v_order bytea;
    -- Per open container: '{' or '[', where its members start, and the key it is the value of.
    v_depth integer := 0;
    v_kinds text[] := '{}';
    v_starts integer[] := '{}';
    v_outer_keys text[] := '{}';
    v_outer_orders bytea[] := '{}';
    -- The members of every open container, innermost last: v_count of them.
    v_keys text[] := '{}';
    v_orders bytea[] := '{}';
    v_values text[] := '{}';
    v_count integer := 0;
    v_unique boolean;
BEGIN
    -- PostgreSQL's own parser decides what is JSON, so the tokens below need no checks.
    BEGIN
        PERFORM p_json::json;
    EXCEPTION WHEN invalid_text_representation OR statement_too_complex THEN
        RAISE EXCEPTION 'not JSON: %', left(p_json, 60) USING ERRCODE = '22023';
    END;
    IF p_json IS NULL THEN
        RAISE EXCEPTION 'JSON text is required, not NULL' USING ERRCODE = '22023';
    END IF;
    -- Refused before the walk below, which takes a step per token: each , : [ ] { } of the
    -- text is a byte of the canonical form (in a string too: json.dumps escapes none of them),
    -- and each other token but the last is followed by one.  Blanks, escapes and long numbers
    -- shrink, so a longer text may still fit; a text with more of these never does.
    IF length(p_json) - length(translate(p_json, ',:[]{}', '')) > 65536 THEN
        RAISE EXCEPTION 'the JSON exceeds 65536 bytes in canonical form' USING ERRCODE = '22023';
    END IF;
    FOR v_token IN SELECT m[1] FROM regexp_matches(
            p_json, '("(?:[^"\\]|\\.)*"|[^\s{}\[\],:"]+|[{}\[\]])', 'g') AS m LOOP
        IF v_token IN ('}', ']') THEN
            -- A container ends: its members become one value, an object's sorted by key.
            IF v_token = '}' THEN
                SELECT count(DISTINCT o) = count(*),
                       '{' || coalesce(string_agg(k || ':' || v, ',' ORDER BY o), '') || '}'
                  INTO v_unique, v_value
                  FROM unnest(v_orders[v_starts[v_depth]:v_count],
                              v_keys[v_starts[v_depth]:v_count],
                              v_values[v_starts[v_depth]:v_count]) AS m(o, k, v);
                IF NOT v_unique THEN
                    RAISE EXCEPTION 'an object repeats a key' USING ERRCODE = '22023';
                END IF;
            ELSE
                v_value := '[' || array_to_string(v_values[v_starts[v_depth]:v_count], ',') || ']';
            END IF;
            v_count := v_starts[v_depth] - 1;
            v_key := v_outer_keys[v_depth];
            v_order := v_outer_orders[v_depth];
            v_depth := v_depth - 1;
        ELSIF v_kinds[v_depth] = '{' AND v_key IS NULL THEN
            -- In an object, a string where a member starts is its key; Python sorts keys by
            -- code point, which their UTF-8 bytes (a NUL included) keep.
            v_key := canonical_string(v_token);
            v_order := key_order(v_key);
            CONTINUE;
        ELSIF v_depth = 32 THEN
            RAISE EXCEPTION 'the JSON nests deeper than 32 levels' USING ERRCODE = '22023';
        ELSIF v_token IN ('{', '[') THEN
            v_depth := v_depth + 1;
            v_kinds[v_depth] := v_token;
            v_starts[v_depth] := v_count + 1;
            v_outer_keys[v_depth] := v_key;
            v_outer_orders[v_depth] := v_order;
            v_key := NULL;
            CONTINUE;
        ELSIF left(v_token, 1) = '"' THEN
            v_value := canonical_string(v_token);
        ELSIF v_token IN ('true', 'false', 'null') THEN
            v_value := v_token;
        ELSE
            v_value := canonical_number(v_token);
        END IF;
        -- The value is complete: refused as soon as it alone is too long.
        IF octet_length(v_value) > 65536 THEN
            RAISE EXCEPTION 'the JSON exceeds 65536 bytes in canonical form'
                USING ERRCODE = '22023';
        END IF;
        v_count := v_count + 1;
        v_keys[v_count] := v_key;
        v_orders[v_count] := v_order;
        v_values[v_count] := v_value;
        v_key := NULL;
    END LOOP;
    RETURN v_value;
END $$;

-- A string token as json.dumps writes it with ensure_ascii=False: escapes decoded, then only
-- ", \ and control characters escaped, \b \f \n \r \t by name and the rest as \u00xx.
CREATE OR REPLACE FUNCTION article7.canonical_string(p_token text) RETURNS text
LANGUAGE plpgsql IMMUTABLE SET search_path = article7, pg_temp
SET standard_conforming_strings = on AS $$
DECLARE
    v_text text;
    v_lone boolean;
BEGIN
    IF strpos(p_token, '\') = 0 THEN
        RETURN p_token;
    END IF;
    -- PostgreSQL decodes the escapes, and to_json escapes the text again as json.dumps does.
    BEGIN
        RETURN to_json(p_token::json #>> '{}')::text;
    EXCEPTION WHEN untranslatable_character THEN
        -- A \u0000, which text cannot hold: decoded piece by piece below instead.
        NULL;
    WHEN invalid_text_representation THEN
        -- Python reads a lone surrogate, then cannot encode it: refused, as canonical() is.
        RAISE EXCEPTION 'a lone UTF-16 surrogate is not text' USING ERRCODE = '22023';
    END;
    SELECT '"' || string_agg(piece, '' ORDER BY n) || '"', bool_or(piece IS NULL)
      INTO v_text, v_lone
      FROM (SELECT n, CASE
                WHEN m[1] IS NOT NULL THEN
                    json_char(65536 + (hex_value(m[1]) - 55296) * 1024 + hex_value(m[2]) - 56320)
                WHEN m[3] IS NOT NULL THEN json_char(hex_value(m[3]))
                WHEN m[4] = '/' THEN '/'
                WHEN m[4] IS NOT NULL THEN '\' || m[4]
                ELSE m[5] END
              FROM regexp_matches(substr(p_token, 2, length(p_token) - 2),
                                  '\\u(d[89ab][0-9a-f]{2})\\u(d[c-f][0-9a-f]{2})'
                                  '|\\u([0-9a-f]{4})|\\(.)|([^\\]+)', 'gi')
                   WITH ORDINALITY AS t(m, n)) AS pieces(n, piece);
    IF v_lone THEN
        RAISE EXCEPTION 'a lone UTF-16 surrogate is not text' USING ERRCODE = '22023';
    END IF;
    RETURN v_text;
END $$;

-- One code point as json.dumps writes it inside a string; NULL for a lone surrogate.
CREATE OR REPLACE FUNCTION article7.json_char(p_code integer) RETURNS text
LANGUAGE sql IMMUTABLE SET search_path = article7, pg_temp
SET standard_conforming_strings = on AS $$
    SELECT CASE
        WHEN p_code BETWEEN 55296 AND 57343 THEN NULL
        WHEN p_code = 34 THEN '\"'
        WHEN p_code = 92 THEN '\\'
        WHEN p_code = 8 THEN '\b'
        WHEN p_code = 12 THEN '\f'
        WHEN p_code = 10 THEN '\n'
        WHEN p_code = 13 THEN '\r'
        WHEN p_code = 9 THEN '\t'
        WHEN p_code < 32 THEN '\u00' || lpad(to_hex(p_code), 2, '0')
        ELSE chr(p_code) END
$$;

CREATE OR REPLACE FUNCTION article7.hex_value(p_hex text) RETURNS integer
LANGUAGE sql IMMUTABLE SET search_path = article7, pg_temp AS $$
    SELECT ('x' || lpad(p_hex, 8, '0'))::bit(32)::integer
$$;

-- A canonical key's UTF-8 bytes, its escapes decoded: bytes sort as Python sorts str keys.
-- Decoded by PostgreSQL when it can, piece by piece when the key holds a \u0000.
CREATE OR REPLACE FUNCTION article7.key_order(p_key text) RETURNS bytea
LANGUAGE sql IMMUTABLE SET search_path = article7, pg_temp
SET standard_conforming_strings = on AS $$
    SELECT CASE
        WHEN strpos(p_key, '\') = 0 THEN convert_to(substr(p_key, 2, length(p_key) - 2), 'UTF8')
        WHEN strpos(p_key, '\u0000') = 0 THEN convert_to(p_key::json #>> '{}', 'UTF8')
        ELSE (SELECT string_agg(CASE
                  WHEN m[2] IS NOT NULL THEN convert_to(m[2], 'UTF8')
                  WHEN m[1] LIKE 'u%' THEN decode(substr(m[1], 4), 'hex')
                  ELSE decode(CASE m[1] WHEN '"' THEN '22' WHEN '\' THEN '5c' WHEN 'b' THEN '08'
                              WHEN 'f' THEN '0c' WHEN 'n' THEN '0a' WHEN 'r' THEN '0d'
                              ELSE '09' END, 'hex') END, '' ORDER BY n)
                FROM regexp_matches(substr(p_key, 2, length(p_key) - 2), '\\(u00..|.)|([^\\]+)',
                                    'g') WITH ORDINALITY AS t(m, n)) END
$$;

-- A number token as Python reads and writes it: without . e E an int (at most 4300 digits,
-- Python's int_max_str_digits; -0 is 0), else a float written as repr() writes it.
CREATE OR REPLACE FUNCTION article7.canonical_number(p_token text) RETURNS text
LANGUAGE plpgsql IMMUTABLE SET search_path = article7, pg_temp
SET standard_conforming_strings = on
-- Above 0, PostgreSQL writes a float's shortest digits that read back the same, as repr().
SET extra_float_digits = 1 AS $$
DECLARE
    v_float double precision;
    v_parts text[];
    v_digits text;
    v_point numeric;
    v_cut numeric;
    v_shorter numeric;
    v_text text;
    v_same boolean;
BEGIN
    IF p_token !~ '[.eE]' THEN
        IF length(p_token) - (left(p_token, 1) = '-')::integer > 4300 THEN
            RAISE EXCEPTION 'an int of more than 4300 digits' USING ERRCODE = '22023';
        END IF;
        RETURN CASE p_token WHEN '-0' THEN '0' ELSE p_token END;
    END IF;
    v_parts := regexp_match(p_token, '^(-?)([0-9]+)(?:\.([0-9]+))?(?:[eE]([-+]?[0-9]+))?$');
    BEGIN
        v_float := p_token::double precision;
    EXCEPTION WHEN numeric_value_out_of_range THEN
        -- Past the range: Python rounds a tiny number to a signed zero, a huge one to infinity,
        -- which no canonical form holds.  The exponent of the first non-zero digit tells.
        v_digits := v_parts[2] || coalesce(v_parts[3], '');
        IF coalesce(v_parts[4], '0')::numeric + length(v_parts[2])
           - (length(v_digits) - length(ltrim(v_digits, '0'))) > 0 THEN
            RAISE EXCEPTION 'the number % is infinite as a float', left(p_token, 60)
                USING ERRCODE = '22023';
        END IF;
        v_float := (v_parts[1] || '0')::double precision;
    END;
    -- Sign, digits and the place of the decimal point in PostgreSQL's text ('1.5e-07', '100').
    v_parts := regexp_match(v_float::text, '^(-?)([0-9]+)(?:\.([0-9]+))?(?:e([-+][0-9]+))?$');
    v_digits := v_parts[2] || coalesce(v_parts[3], '');
    v_point := length(v_parts[2]) + coalesce(v_parts[4]::integer, 0)
               - (length(v_digits) - length(ltrim(v_digits, '0')));
    v_digits := rtrim(ltrim(v_digits, '0'), '0');
    IF v_digits = '' THEN
        RETURN v_parts[1] || '0.0';
    END IF;
    -- The value is 0.<v_digits> times 10^v_point.  PostgreSQL never writes a decimal that lies
    -- exactly half-way to a neighbouring double, but Python's repr() does when that decimal
    -- reads back as this double: it does so only for an even mantissa (reading rounds half to
    -- even), as 1e+23 is.  Then a shorter decimal inside the closed interval is one of the two
    -- around PostgreSQL's, cut to k digits: tried shortest first, each read back.
    IF get_byte(float8send(v_float), 7) % 2 = 0 THEN
        <<search>>
        FOR k IN 1 .. length(v_digits) - 1 LOOP
            v_cut := left(v_digits, k)::numeric;
            FOREACH v_shorter IN ARRAY ARRAY[v_cut, v_cut + 1] LOOP
                v_text := v_shorter || 'e' || (v_point - k);
                -- Beyond the doubles' range the cast raises, and no decimal there is this one.
                v_same := CASE WHEN v_text::numeric BETWEEN 2.4703282292062328e-324
                                                        AND 1.7976931348623158e308
                               THEN v_text::double precision = abs(v_float) ELSE false END;
                IF v_same THEN
                    -- 99 + 1 is 100: the point moves with the number of digits.
                    v_point := v_point - k + length(v_shorter::text);
                    v_digits := rtrim(v_shorter::text, '0');
                    EXIT search;
                END IF;
            END LOOP;
        END LOOP;
    END IF;
    -- repr() writes an exponent when the point lies 4 places before the first digit or 17
    -- after it: 0.0001 and 1e-05, 1000000000000000.0 and 1e+16.
    IF v_point <= -4 OR v_point > 16 THEN
        RETURN v_parts[1] || left(v_digits, 1)
               || CASE WHEN length(v_digits) > 1 THEN '.' || substr(v_digits, 2) ELSE '' END
               || 'e' || CASE WHEN v_point > 0 THEN '+' ELSE '-' END
               || lpad(abs(v_point - 1)::text, greatest(2, length(abs(v_point - 1)::text)), '0');
    ELSIF v_point <= 0 THEN
        RETURN v_parts[1] || '0.' || repeat('0', (-v_point)::integer) || v_digits;
    ELSIF v_point >= length(v_digits) THEN
        RETURN v_parts[1] || v_digits || repeat('0', (v_point - length(v_digits))::integer)
               || '.0';
    END IF;
    RETURN v_parts[1] || left(v_digits, v_point::integer) || '.'
           || substr(v_digits, v_point::integer + 1);
END $$;

COMMIT;
