-- 第一篇：工具干完了，回执丢了怎么办？ PostgreSQL 版。
-- Article 1: the tool did the work but the receipt was lost. The PostgreSQL edition.
--
-- 载入 Load: psql -v ON_ERROR_STOP=1 -f article1.sql   (again is safe: every row stays)
-- Everything lives in the schema article1, which must be the loading role's; the load pins its
-- own search_path, and every function sets its own, so a caller's path (a temporary table,
-- article7 first, another role's schema) never changes what runs or what it reads.
-- 调用 Call: SELECT article1.receive('agent', 'k1', '{"title": "打印机卡纸"}', 0, 0);
-- JSON goes in as text, so that 1.0 and 1e3 reach the function as written; every function
-- returns a jsonb object with a "status"; malformed input raises 22023 and stores nothing.
-- The sender's tables (requests, outbox, resolutions) and the receiver's (tickets, receipts,
-- retention) share the schema for the reader; two systems load the file in two databases.
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
        RAISE EXCEPTION 'article1 needs a UTF8 database, not %',
            pg_catalog.current_setting('server_encoding');
    END IF;
END $$;

-- Only for this load: a second load does not list what it keeps.
SET LOCAL client_min_messages = warning;
CREATE SCHEMA IF NOT EXISTS article1;
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
    SELECT nspowner INTO v_owner FROM pg_catalog.pg_namespace WHERE nspname = 'article1';
    IF v_owner <> (SELECT oid FROM pg_catalog.pg_roles WHERE rolname = current_user) THEN
        RAISE EXCEPTION 'schema article1 belongs to %, not to %, who loads this file',
            pg_catalog.pg_get_userbyid(v_owner), current_user
            USING HINT = 'Drop or rename that schema, or load this file as its owner.';
    END IF;
    SELECT pg_catalog.string_agg(pg_catalog.format('%s %s of %s', o.type, o.identity,
                                                   pg_catalog.pg_get_userbyid(d.refobjid)),
                                 ', ' ORDER BY o.identity)
      INTO v_others
      FROM pg_catalog.pg_shdepend d,
           LATERAL pg_catalog.pg_identify_object(d.classid, d.objid, d.objsubid) o
     WHERE d.deptype = 'o' AND o.schema = 'article1' AND d.refobjid <> v_owner
       AND d.dbid = (SELECT oid FROM pg_catalog.pg_database
                      WHERE datname = pg_catalog.current_database());
    IF v_others IS NOT NULL THEN
        RAISE EXCEPTION 'schema article1 holds what another role owns: %', v_others;
    END IF;
    SELECT pg_catalog.string_agg(CASE a.grantee WHEN 0 THEN 'PUBLIC'
                                 ELSE pg_catalog.pg_get_userbyid(a.grantee) END, ', ')
      INTO v_others
      FROM pg_catalog.pg_namespace n, LATERAL pg_catalog.aclexplode(n.nspacl) a
     WHERE n.nspname = 'article1' AND a.privilege_type = 'CREATE' AND a.grantee <> n.nspowner;
    IF v_others IS NOT NULL THEN
        RAISE EXCEPTION 'schema article1 lets % create in it', v_others;
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
     WHERE c.relnamespace = 'article1'::pg_catalog.regnamespace AND NOT t.tgisinternal
       AND p.proowner <> v_owner
       AND p.pronamespace <> 'pg_catalog'::pg_catalog.regnamespace;
    IF v_others IS NOT NULL THEN
        RAISE EXCEPTION 'article1''s tables have triggers that run another role''s code: %',
            v_others USING HINT = 'Drop those triggers, or load this file as that role.';
    END IF;
END $$;

-- Tables are created only when missing, so a second load keeps the rows.  An edition whose
-- tables differ says here how to upgrade from the one before; this file is edition 3, and
-- refuses a schema of any edition but 1, 2 and 3.  From 1: outbox.owner_host, and claim() and
-- reconcile() take the claimer's machine.  From 2: outbox.owner_started, and they take the
-- claimer's start time too; the table late_results (below).
CREATE TABLE IF NOT EXISTS article1.edition (
    id integer PRIMARY KEY CHECK (id = 1),
    version integer NOT NULL);
INSERT INTO article1.edition VALUES (1, 3) ON CONFLICT DO NOTHING;
DO $$
BEGIN
    IF (SELECT version FROM article1.edition) NOT IN (1, 2, 3) THEN
        RAISE EXCEPTION 'article1 holds edition %, this file is edition 3',
            (SELECT version FROM article1.edition);
    END IF;
END $$;


-- === 第一篇 §2: the sender writes the intent first =========================================
-- requests: one intent per (caller, key), its canonical payload and that text's digest.
CREATE TABLE IF NOT EXISTS article1.requests (
    caller text NOT NULL CHECK (length(caller) BETWEEN 1 AND 200),
    key text NOT NULL CHECK (length(key) BETWEEN 1 AND 200),
    mode text NOT NULL CHECK (mode IN ('idempotent', 'external')),
    digest text NOT NULL,
    payload text NOT NULL,
    issued_at bigint NOT NULL CHECK (issued_at BETWEEN 0 AND 4611686018427387904),
    PRIMARY KEY (caller, key),
    -- The outbox copies mode: this key lets it point at the intent's own mode.
    UNIQUE (caller, key, mode));
-- outbox: the row a worker claims (§5), in id order.  owner_pid is the claimer's process on
-- the machine owner_host names, started at owner_started (in clock ticks since that machine
-- booted): only that machine can tell reconcile() whether that very process is gone.
CREATE TABLE IF NOT EXISTS article1.outbox (
    id bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    caller text NOT NULL,
    key text NOT NULL,
    mode text NOT NULL,
    state text NOT NULL DEFAULT 'pending' CHECK (state IN
        ('pending', 'inflight', 'done', 'unknown', 'blocked', 'abandoned')),
    attempts integer NOT NULL DEFAULT 0 CHECK (attempts >= 0),
    lease_until bigint,
    response jsonb,
    owner_pid integer,
    owner_host text,
    owner_started bigint,
    UNIQUE (caller, key),
    FOREIGN KEY (caller, key, mode) REFERENCES article1.requests (caller, key, mode));
CREATE INDEX IF NOT EXISTS outbox_due ON article1.outbox (state, lease_until);
-- Editions 1 and 2 to 3: a row claimed under edition 1 keeps owner_host NULL, one claimed
-- under 1 or 2 keeps owner_started NULL.
ALTER TABLE article1.outbox ADD COLUMN IF NOT EXISTS owner_host text;
ALTER TABLE article1.outbox ADD COLUMN IF NOT EXISTS owner_started bigint;
-- late_results (beyond 第一篇): an acknowledgement refused because the row is no longer in
-- flight under its attempt (a later attempt took it, or it was settled) still shows that the
-- attempt reached the tool.  acknowledge() records it here, once per response, and never
-- applies it; reconcile() shows it, and takes no absence as proven beside it.
CREATE TABLE IF NOT EXISTS article1.late_results (
    id bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    caller text NOT NULL,
    key text NOT NULL,
    attempt integer NOT NULL CHECK (attempt >= 1),
    response jsonb NOT NULL,
    -- The SHA-256 of the response's canonical text: the same late result again adds no row.
    response_digest text NOT NULL,
    -- When it arrived, by the server's clock: acknowledge() takes no tick.
    arrived_at timestamptz NOT NULL,
    UNIQUE (caller, key, attempt, response_digest),
    FOREIGN KEY (caller, key) REFERENCES article1.requests (caller, key));
UPDATE article1.edition SET version = 3 WHERE version IN (1, 2);
-- resolutions: a person's decisions on unknown or blocked rows, an audit trail.
CREATE TABLE IF NOT EXISTS article1.resolutions (
    id bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    caller text NOT NULL,
    key text NOT NULL,
    attempt integer NOT NULL,
    decision text NOT NULL CHECK (decision IN ('done', 'retry', 'abandon')),
    decided_by text NOT NULL,
    reason text NOT NULL,
    evidence jsonb,
    FOREIGN KEY (caller, key) REFERENCES article1.requests (caller, key));
CREATE INDEX IF NOT EXISTS resolutions_by_request ON article1.resolutions (caller, key);
CREATE OR REPLACE FUNCTION article1.never_rewritten() RETURNS trigger
LANGUAGE plpgsql SET search_path = article1, pg_temp AS $$
BEGIN
    RAISE EXCEPTION 'a recorded decision is never rewritten';
END $$;
CREATE OR REPLACE TRIGGER resolutions_never_rewritten BEFORE UPDATE OR DELETE
    ON article1.resolutions FOR EACH ROW EXECUTE FUNCTION article1.never_rewritten();
CREATE OR REPLACE TRIGGER resolutions_never_truncated BEFORE TRUNCATE ON article1.resolutions
    FOR EACH STATEMENT EXECUTE FUNCTION article1.never_rewritten();

-- === 第一篇 §3: the receiver's ticket and receipt =========================================
CREATE SEQUENCE IF NOT EXISTS article1.ticket_ids;
CREATE TABLE IF NOT EXISTS article1.tickets (
    id bigint PRIMARY KEY DEFAULT nextval('article1.ticket_ids'),
    caller text NOT NULL,
    key text NOT NULL,
    digest text NOT NULL,
    payload text NOT NULL);
ALTER SEQUENCE article1.ticket_ids OWNED BY article1.tickets.id;
CREATE TABLE IF NOT EXISTS article1.receipts (
    caller text NOT NULL,
    key text NOT NULL,
    digest text NOT NULL,
    -- Written before its ticket in the same transaction: the key is checked at COMMIT.
    ticket_id bigint NOT NULL UNIQUE
        REFERENCES article1.tickets (id) DEFERRABLE INITIALLY DEFERRED,
    -- When it was written, for purge().
    tick bigint NOT NULL,
    PRIMARY KEY (caller, key));
CREATE INDEX IF NOT EXISTS receipts_by_tick ON article1.receipts (tick);
-- Beyond 第一篇: receipts written before low_water may be gone, so a request issued before
-- it that finds no receipt is refused.  One row, locked by every receive() and purge().
CREATE TABLE IF NOT EXISTS article1.retention (
    id integer PRIMARY KEY CHECK (id = 1),
    low_water bigint NOT NULL CHECK (low_water >= 0));
INSERT INTO article1.retention VALUES (1, 0) ON CONFLICT DO NOTHING;

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
             WHERE c.relnamespace = 'article1'::pg_catalog.regnamespace
               AND a.privilege_type = 'TRIGGER' AND a.grantee <> c.relowner
             GROUP BY a.grantee) g;
    IF v_others IS NOT NULL THEN
        RAISE EXCEPTION 'article1''s tables let other roles create triggers on them: %', v_others
            USING HINT = 'REVOKE TRIGGER ON ALL TABLES IN SCHEMA article1 FROM those roles.';
    END IF;
END $$;


-- === 第一篇 §2: enqueue ====================================================================
-- 意图与 outbox 行在同一事务里写下；同一请求 ID 再来是 duplicate，换了参数是 conflict。
-- Returns {"status": "accepted"} (intent and outbox row committed), "duplicate" (the same
-- intent again, nothing added) or "conflict" (the key stands for another payload or mode).
CREATE OR REPLACE FUNCTION article1.enqueue(p_caller text, p_key text, p_payload text,
                                            p_now numeric,
                                            p_mode text DEFAULT 'idempotent') RETURNS jsonb
LANGUAGE plpgsql SET search_path = article1, pg_temp AS $$
DECLARE
    v_payload text;
    v_old requests%ROWTYPE;
BEGIN
    PERFORM check_identity(p_caller, p_key);
    v_payload := canonical(p_payload);
    PERFORM check_ticks(p_now, p_now);
    IF p_mode IS NULL OR p_mode NOT IN ('idempotent', 'external') THEN
        RAISE EXCEPTION 'mode must be idempotent or external' USING ERRCODE = '22023';
    END IF;
    -- A racing copy waits here for the first to end, then finds its row below.
    INSERT INTO requests VALUES (p_caller, p_key, p_mode, digest_of(v_payload), v_payload, p_now)
        ON CONFLICT DO NOTHING;
    IF FOUND THEN
        INSERT INTO outbox (caller, key, mode) VALUES (p_caller, p_key, p_mode);
        RETURN '{"status": "accepted"}';
    END IF;
    SELECT * INTO v_old FROM requests WHERE caller = p_caller AND key = p_key;
    IF (v_old.mode, v_old.digest) = (p_mode, digest_of(v_payload)) THEN
        RETURN '{"status": "duplicate"}';
    END IF;
    RETURN '{"status": "conflict"}';
END $$;


-- === 第一篇 §3: receive, one ticket per (caller, key) ======================================
-- 先以共享锁读低水位，再查回执、写回执和工单：purge 等它结束，任何隔离级别都只有一张工单。
-- Returns {"status": "ticket", "response": {"caller", "key", "digest", "ticket_id"}}, the same
-- for every copy of the request; or "conflict" (the key came with another payload),
-- "expired" with "low_water" (no receipt, issued before the mark: perhaps a late replay of a
-- purged one), "corrupt" (the receipt disagrees with its ticket).
CREATE OR REPLACE FUNCTION article1.receive(p_caller text, p_key text, p_payload text,
                                            p_issued_at numeric, p_now numeric) RETURNS jsonb
LANGUAGE plpgsql SET search_path = article1, pg_temp AS $$
DECLARE
    v_payload text;
    v_digest text;
    v_low_water bigint;
    v_old record;
    v_ticket bigint;
BEGIN
    PERFORM check_identity(p_caller, p_key);
    v_payload := canonical(p_payload);
    v_digest := digest_of(v_payload);
    PERFORM check_ticks(p_issued_at, p_now);
    -- The mark first, in share mode: a purge in flight is waited for, and none starts before
    -- this call ends, so the receipt and the mark read below agree.  At REPEATABLE READ and
    -- SERIALIZABLE a mark raised after this call's snapshot raises 40001 here: the retry
    -- sees it.
    SELECT low_water INTO v_low_water FROM retention FOR SHARE;
    LOOP
        SELECT r.digest, r.ticket_id,
               coalesce((t.caller, t.key, t.digest) = (r.caller, r.key, r.digest), false)
                   AS intact,
               t.payload IS NOT DISTINCT FROM v_payload AS holds
          INTO v_old
          FROM receipts r LEFT JOIN tickets t ON t.id = r.ticket_id
         WHERE r.caller = p_caller AND r.key = p_key;
        IF FOUND THEN
            -- As reliability.receive: a ticket that disagrees with its receipt vouches for
            -- nothing (corrupt); else another payload is a conflict; and the ticket must hold
            -- this very payload, or the replay would vouch for another.
            IF v_old.intact AND v_old.digest <> v_digest THEN
                RETURN '{"status": "conflict"}';
            END IF;
            IF NOT (v_old.intact AND v_old.holds) THEN
                RETURN '{"status": "corrupt"}';
            END IF;
            RETURN jsonb_build_object('status', 'ticket', 'response', jsonb_build_object(
                'caller', p_caller, 'key', p_key, 'digest', v_digest,
                'ticket_id', v_old.ticket_id));
        END IF;
        IF p_issued_at < v_low_water THEN
            RETURN jsonb_build_object('status', 'expired', 'low_water', v_low_water);
        END IF;
        -- The receipt before its ticket: a copy racing this call waits here until it ends.
        INSERT INTO receipts VALUES (p_caller, p_key, v_digest, nextval('ticket_ids'), p_now)
            ON CONFLICT DO NOTHING
            RETURNING ticket_id INTO v_ticket;
        IF FOUND THEN
            INSERT INTO tickets VALUES (v_ticket, p_caller, p_key, v_digest, v_payload);
            RETURN jsonb_build_object('status', 'ticket', 'response', jsonb_build_object(
                'caller', p_caller, 'key', p_key, 'digest', v_digest, 'ticket_id', v_ticket));
        END IF;
        -- A copy committed its receipt meanwhile: at READ COMMITTED the next statement sees
        -- it; at the other levels the insert above raised 40001 instead.
    END LOOP;
END $$;


-- === 第一篇 §5: claim and acknowledge, with attempt numbers ===============================
-- 按 id 顺序领取最早到期的一行，尝试编号加一；途经的、租约已过的 external 行成为 unknown。
-- Takes the oldest due row (issued by p_now, pending or in flight past its lease) that no
-- racing claim holds: attempt + 1, leased until p_now + 10.  Returns {"status": "claimed",
-- "caller", "key", "attempt", "mode", "digest", "payload", "issued_at", "now"}, where payload
-- is the canonical JSON text to send as it is, or {"status": "nothing due", "now"}.  On the
-- way, as in reliability.claim, each due row before the one it takes is parked: an external
-- one past its lease becomes unknown (§6); one unanswered 10 times since a person last
-- decided, or whose payload is not the canonical text of its digest, becomes blocked.
-- p_owner_pid is the claimer's process id on the machine p_owner_host names, and
-- p_owner_started that process's start time there (clock ticks since the machine booted),
-- recorded for reconcile()'s caller: a pid alone says nothing once claimers run on several
-- machines, and a pid and a machine name nothing once a restarted container gives its new
-- process the old one's pid (README.md: how an agent computes them).
-- The editions before took no machine, or no start time: their claim() and reconcile() go,
-- or they would stay callable.
DROP FUNCTION IF EXISTS article1.claim(numeric, numeric);
DROP FUNCTION IF EXISTS article1.reconcile(text, text, text, numeric, boolean);
DROP FUNCTION IF EXISTS article1.claim(numeric, numeric, text);
DROP FUNCTION IF EXISTS article1.reconcile(text, text, text, numeric, boolean, numeric, text);
CREATE OR REPLACE FUNCTION article1.claim(p_now numeric, p_owner_pid numeric,
                                          p_owner_host text, p_owner_started numeric)
RETURNS jsonb
LANGUAGE plpgsql SET search_path = article1, pg_temp AS $$
DECLARE
    v record;
    v_now bigint;
BEGIN
    PERFORM check_ticks(0, p_now);
    PERFORM check_owner(p_owner_pid, p_owner_host, p_owner_started);
    IF p_owner_host IS NULL OR p_owner_started IS NULL THEN
        RAISE EXCEPTION 'owner_host and owner_started must name the claimer''s machine and'
                        ' its start there' USING ERRCODE = '22023';
    END IF;
    -- A bigint, so that lease_until and issued_at are compared by their own type's index.
    v_now := p_now;
    LOOP
        SELECT o.id, o.caller, o.key, o.mode, o.state, o.attempts, r.digest, r.payload,
               r.issued_at, o.attempts - coalesce((SELECT max(s.attempt) FROM resolutions s
                                                   WHERE s.caller = o.caller AND s.key = o.key),
                                                  0) AS used
          INTO v
          FROM outbox o JOIN requests r ON r.caller = o.caller AND r.key = o.key
         WHERE (o.state = 'pending' OR (o.state = 'inflight' AND o.lease_until <= v_now))
           AND r.issued_at <= v_now
         ORDER BY o.id
         LIMIT 1
           FOR UPDATE OF o SKIP LOCKED;
        IF NOT FOUND THEN
            RETURN jsonb_build_object('status', 'nothing due', 'now', v_now);
        END IF;
        IF v.state = 'inflight' AND v.mode = 'external' THEN
            -- The expired attempt may have reached a tool without receipts: never again.
            UPDATE outbox SET state = 'unknown' WHERE id = v.id;
        ELSIF v.used >= 10 THEN
            UPDATE outbox SET state = 'blocked', response = jsonb_build_object(
                'error', format('no valid answer after %s attempts', v.used))
             WHERE id = v.id;
        ELSIF NOT is_canonical(v.payload, v.digest) THEN
            UPDATE outbox SET state = 'blocked', response = jsonb_build_object(
                'error', 'corrupt intent: not the text, payload and digest enqueue() stores')
             WHERE id = v.id;
        ELSE
            UPDATE outbox SET state = 'inflight', attempts = attempts + 1,
                   lease_until = v_now + 10, owner_pid = p_owner_pid, owner_host = p_owner_host,
                   owner_started = p_owner_started
             WHERE id = v.id;
            RETURN jsonb_build_object('status', 'claimed', 'caller', v.caller, 'key', v.key,
                                      'attempt', v.attempts + 1, 'mode', v.mode,
                                      'digest', v.digest, 'payload', v.payload,
                                      'issued_at', v.issued_at, 'now', v_now);
        END IF;
    END LOOP;
END $$;

-- 只有仍持有该行的尝试能确认；同一尝试、同一回复再确认一次，答案不变；迟到的结果记下作证据，不应用。
-- Records a response as done, only for the attempt that still holds the row: {"status":
-- "acknowledged"}.  The same attempt with the same response again, after a lost reply,
-- answers "acknowledged" again.  Anything else changes no outbox row: {"status": "refused",
-- "state", "attempts"}; when the attempt was claimed but the row is no longer in flight under
-- it (a later attempt took it, or it was settled), the response is a late result, recorded
-- in late_results once per (caller, key, attempt, response), the first arrival kept.  An
-- attempt never claimed records nothing.  A response that does not answer this request raises
-- 22023 and records nothing.
CREATE OR REPLACE FUNCTION article1.acknowledge(p_caller text, p_key text, p_attempt numeric,
                                                p_response text) RETURNS jsonb
LANGUAGE plpgsql SET search_path = article1, pg_temp AS $$
DECLARE
    v_row record;
    v_response jsonb;
BEGIN
    PERFORM check_identity(p_caller, p_key);
    -- As reliability.acknowledge: attempts count from 1, and none passes 2^62.
    IF NOT coalesce(scale(p_attempt) = 0 AND p_attempt BETWEEN 1 AND 4611686018427387904,
                    false) THEN
        RAISE EXCEPTION 'attempt must be an integer from 1 to 2^62' USING ERRCODE = '22023';
    END IF;
    -- Locked: a racing acknowledgement of the row waits here, then sees what this one did.
    SELECT o.state, o.attempts, o.response, r.digest INTO v_row
      FROM outbox o JOIN requests r ON r.caller = o.caller AND r.key = o.key
     WHERE o.caller = p_caller AND o.key = p_key
       FOR UPDATE OF o;
    IF NOT FOUND THEN
        RAISE EXCEPTION 'no request %/%', p_caller, p_key USING ERRCODE = '22023';
    END IF;
    v_response := response_of(p_response, p_caller, p_key, v_row.digest);
    IF v_row.state = 'inflight' AND v_row.attempts = p_attempt THEN
        UPDATE outbox SET state = 'done', response = v_response
         WHERE caller = p_caller AND key = p_key;
        RETURN '{"status": "acknowledged"}';
    END IF;
    IF (v_row.state, v_row.attempts, v_row.response) = ('done', p_attempt, v_response) THEN
        RETURN '{"status": "acknowledged"}';
    END IF;
    -- Late: evidence that this attempt reached the tool, never applied to the row.  A copy
    -- racing this one waits on the row's lock above; at REPEATABLE READ and SERIALIZABLE the
    -- copy that did not see this one commit raises 40001 here, and its retry adds no row.
    IF p_attempt <= v_row.attempts THEN
        INSERT INTO late_results (caller, key, attempt, response, response_digest, arrived_at)
            VALUES (p_caller, p_key, p_attempt, v_response, digest_of(canonical(p_response)),
                    statement_timestamp())
            ON CONFLICT (caller, key, attempt, response_digest) DO NOTHING;
    END IF;
    RETURN jsonb_build_object('status', 'refused', 'state', v_row.state,
                              'attempts', v_row.attempts);
END $$;


-- === beyond 第一篇: leaving unknown, by evidence or by a person ============================
-- 工具在 PostgreSQL 之外：对账的证据由调用方带来；人的决定连同审计行一起写下，审计行不改不删。
-- The external tool is outside PostgreSQL, so the caller brings its evidence, in this order:
-- 1. read the row's owner_pid, owner_host and owner_started, and on that machine check that
--    the claimer (and any tool child it started) is gone: p_gone, about the process p_owner_pid
--    started at p_owner_started on p_owner_host; only that machine can know, PostgreSQL cannot;
-- 2. then ask the tool's own lookup for (caller, key): p_found, the JSON array of the
--    responses it holds, each {"caller", "key", "digest", "ticket_id"};
-- 3. then call reconcile.  Once nobody can act, a ticket found absent stays absent.
-- One ticket with the request's digest makes the row done with it; none sends it back to
-- pending, only once the lease has ended, p_gone is true of the row's own claimer (a claimer
-- checked before a person's retry and a later claim is not the one that may act, nor is the
-- process a restart gave the same pid), and no late result shows that an attempt reached the
-- tool all the same (the lookup then misses what the tool did); anything less certain leaves
-- it unknown.  Returns {"status": the row's state, "reason" or "response"}, and "late": the
-- row's late results, oldest first, {"attempt", "response", "arrived_at"}, when it has any:
-- shown as evidence for a person, never applied.  The owner may be NULL where p_gone is
-- false; a row claimed under edition 1 recorded no host, and under 1 or 2 no start time: it
-- is named with NULL for them.
CREATE OR REPLACE FUNCTION article1.reconcile(p_caller text, p_key text, p_found text,
                                              p_now numeric, p_gone boolean,
                                              p_owner_pid numeric, p_owner_host text,
                                              p_owner_started numeric)
RETURNS jsonb
LANGUAGE plpgsql SET search_path = article1, pg_temp AS $$
DECLARE
    v_found jsonb;
    v_row record;
    v_late jsonb;
    v_answer jsonb;
BEGIN
    PERFORM check_identity(p_caller, p_key);
    v_found := found_of(p_found, p_caller, p_key);
    PERFORM check_ticks(0, p_now);
    IF p_gone IS NULL THEN
        RAISE EXCEPTION 'gone must be true or false' USING ERRCODE = '22023';
    END IF;
    IF p_gone THEN
        PERFORM check_owner(p_owner_pid, p_owner_host, p_owner_started);
    END IF;
    -- Locked: a person's decision racing this call waits, or is waited for and then seen; so
    -- does an acknowledgement, and with it a late result.
    SELECT o.state, o.attempts, o.lease_until, o.owner_pid, o.owner_host, o.owner_started,
           r.digest INTO v_row
      FROM outbox o JOIN requests r ON r.caller = o.caller AND r.key = o.key
     WHERE o.caller = p_caller AND o.key = p_key
       FOR UPDATE OF o;
    IF NOT FOUND THEN
        RAISE EXCEPTION 'no request %/%', p_caller, p_key USING ERRCODE = '22023';
    END IF;
    SELECT jsonb_agg(jsonb_build_object('attempt', attempt, 'response', response,
                                        'arrived_at', arrived_at) ORDER BY id)
      INTO v_late
      FROM late_results WHERE caller = p_caller AND key = p_key;
    IF v_row.state <> 'unknown' THEN
        v_answer := jsonb_build_object('status', v_row.state,
                                       'reason', 'not unknown: nothing to reconcile');
    ELSIF jsonb_array_length(v_found) = 1 AND v_found -> 0 ->> 'digest' = v_row.digest THEN
        UPDATE outbox SET state = 'done', response = v_found -> 0, owner_pid = NULL,
               owner_host = NULL, owner_started = NULL
         WHERE caller = p_caller AND key = p_key;
        v_answer := jsonb_build_object('status', 'done', 'response', v_found -> 0);
    ELSIF jsonb_array_length(v_found) > 0 THEN
        v_answer := jsonb_build_object('status', 'unknown', 'reason', format(
            'the tool holds %s ticket(s) that do not settle it', jsonb_array_length(v_found)));
    ELSIF p_now < coalesce(v_row.lease_until, 0) OR NOT p_gone THEN
        v_answer := jsonb_build_object('status', 'unknown', 'reason',
                                       'no ticket yet, but the unanswered attempt may still act');
    ELSIF (v_row.owner_pid, v_row.owner_host, v_row.owner_started)
          IS DISTINCT FROM (p_owner_pid, p_owner_host, p_owner_started) THEN
        v_answer := jsonb_build_object('status', 'unknown', 'reason', format(
            'gone is about another claimer: this attempt''s is pid %s on %s, started at %s',
            v_row.owner_pid, coalesce(v_row.owner_host, 'a machine edition 1 did not record'),
            coalesce(v_row.owner_started::text, 'a time editions 1 and 2 did not record')));
    ELSIF v_late IS NOT NULL THEN
        v_answer := jsonb_build_object('status', 'unknown', 'reason', 'the tool holds no'
                                       ' ticket, yet a late result shows an attempt reached it');
    ELSE
        UPDATE outbox SET state = 'pending', owner_pid = NULL, owner_host = NULL,
               owner_started = NULL
         WHERE caller = p_caller AND key = p_key;
        v_answer := jsonb_build_object('status', 'pending',
                                       'reason', 'proven absent: retry under the same key');
    END IF;
    IF v_late IS NOT NULL THEN
        v_answer := v_answer || jsonb_build_object('late', v_late);
    END IF;
    RETURN v_answer;
END $$;

-- 人对 unknown 或 blocked 行的决定，针对他看到的那次尝试；之后被认领过的行拒绝，同一决定重放答原答案。
-- A person's decision on an unknown or blocked row, and its audit row, in one transaction:
-- "done" (p_evidence: the tool's response for this request), "retry" (pending under the same
-- key, 10 attempts again) or "abandon".  p_attempt is the row's attempt the person looked at.
-- Returns {"status": the new state, "resolution": the audit row's id}.  Refused, changing
-- nothing, with {"status": "refused", "state", "attempts", "reason"}: a row a claim has taken
-- since that attempt (it moved on: a decision asked again after a lost reply never becomes a
-- second one), or a row neither unknown nor blocked.  The same call again, while the row is as
-- that decision left it, answers the same without a second row.  An attempt never claimed
-- raises 22023.
-- The edition before named no attempt: its resolve() goes, or it would stay callable.
DROP FUNCTION IF EXISTS article1.resolve(text, text, text, text, text, text);
CREATE OR REPLACE FUNCTION article1.resolve(p_caller text, p_key text, p_decision text,
                                            p_attempt numeric, p_by text, p_why text,
                                            p_evidence text DEFAULT NULL) RETURNS jsonb
LANGUAGE plpgsql SET search_path = article1, pg_temp AS $$
DECLARE
    v_row record;
    v_last resolutions%ROWTYPE;
    v_state text;
    v_given text;
    v_evidence jsonb;
    v_id bigint;
BEGIN
    PERFORM check_identity(p_caller, p_key);
    IF p_decision IS NULL OR p_decision NOT IN ('done', 'retry', 'abandon') THEN
        RAISE EXCEPTION 'decision must be one of done, retry, abandon' USING ERRCODE = '22023';
    END IF;
    IF NOT coalesce(scale(p_attempt) = 0 AND p_attempt BETWEEN 0 AND 4611686018427387904,
                    false) THEN
        RAISE EXCEPTION 'attempt must be an integer from 0 to 2^62' USING ERRCODE = '22023';
    END IF;
    PERFORM check_reason(p_by, 'by');
    PERFORM check_reason(p_why, 'why');
    IF (p_evidence IS NULL) = (p_decision = 'done') THEN
        RAISE EXCEPTION 'evidence is required for done, and only for done' USING ERRCODE = '22023';
    END IF;
    IF p_evidence IS NOT NULL THEN
        v_given := canonical(p_evidence);
    END IF;
    -- Locked: a racing decision, claim or reconcile of the row waits, then sees this one.
    SELECT o.state, o.attempts, r.digest INTO v_row
      FROM outbox o JOIN requests r ON r.caller = o.caller AND r.key = o.key
     WHERE o.caller = p_caller AND o.key = p_key
       FOR UPDATE OF o;
    IF NOT FOUND THEN
        RAISE EXCEPTION 'no request %/%', p_caller, p_key USING ERRCODE = '22023';
    END IF;
    IF p_attempt > v_row.attempts THEN
        RAISE EXCEPTION 'attempt % of %/% was never claimed: it is at attempt %', p_attempt,
            p_caller, p_key, v_row.attempts USING ERRCODE = '22023';
    END IF;
    v_state := CASE p_decision WHEN 'done' THEN 'done' WHEN 'retry' THEN 'pending'
               ELSE 'abandoned' END;
    -- This very decision, already recorded at this attempt: its reply was lost.  It is
    -- answered again only while the row is as it left it.
    SELECT * INTO v_last FROM resolutions WHERE caller = p_caller AND key = p_key
     ORDER BY id DESC LIMIT 1;
    IF FOUND AND v_row.attempts = p_attempt
             AND (v_last.attempt, v_last.decision, v_last.decided_by, v_last.reason)
                 = (p_attempt, p_decision, p_by, p_why)
             AND v_given IS NOT DISTINCT FROM (CASE WHEN v_last.evidence IS NOT NULL
                                                    THEN canonical(v_last.evidence::text) END) THEN
        IF v_row.state = v_state THEN
            RETURN jsonb_build_object('status', v_state, 'resolution', v_last.id);
        END IF;
        RETURN jsonb_build_object('status', 'refused', 'state', v_row.state,
                                  'attempts', v_row.attempts,
                                  'reason', 'the row moved on since this decision was recorded');
    END IF;
    IF v_row.attempts <> p_attempt THEN
        RETURN jsonb_build_object('status', 'refused', 'state', v_row.state,
                                  'attempts', v_row.attempts, 'reason', 'the row moved on:'
                                  ' a claim took it since the attempt decided on');
    END IF;
    IF v_row.state NOT IN ('unknown', 'blocked') THEN
        RETURN jsonb_build_object('status', 'refused', 'state', v_row.state,
                                  'attempts', v_row.attempts,
                                  'reason', 'only an unknown or blocked row is resolved by hand');
    END IF;
    IF p_evidence IS NOT NULL THEN
        v_evidence := response_of(p_evidence, p_caller, p_key, v_row.digest);
    END IF;
    UPDATE outbox SET state = v_state, response = v_evidence, owner_pid = NULL,
           owner_host = NULL, owner_started = NULL
     WHERE caller = p_caller AND key = p_key;
    -- The attempt it was decided at: claim() counts 10 attempts from here.
    INSERT INTO resolutions (caller, key, attempt, decision, decided_by, reason, evidence)
        VALUES (p_caller, p_key, p_attempt, p_decision, p_by, p_why, v_evidence)
        RETURNING id INTO v_id;
    RETURN jsonb_build_object('status', v_state, 'resolution', v_id);
END $$;


-- === beyond 第一篇: receipts are not kept forever ==========================================
-- 删除 now - window 之前写下的回执并抬高低水位；低水位不倒退，正好在低水位写下的回执留着。
-- Deletes the receipts written before p_now - p_window and raises the mark to it, atomically:
-- {"status": "purged", "deleted", "low_water"}, or {"status": "backwards", "low_water"} when
-- the mark would move back (nothing changed).  A receipt written at the mark stays.
CREATE OR REPLACE FUNCTION article1.purge(p_now numeric, p_window numeric) RETURNS jsonb
LANGUAGE plpgsql SET search_path = article1, pg_temp AS $$
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
    -- Locked first: purges queue here, and receive() calls in flight are waited for.
    SELECT low_water INTO v_low_water FROM retention FOR UPDATE;
    IF v_mark < v_low_water THEN
        RETURN jsonb_build_object('status', 'backwards', 'low_water', v_low_water);
    END IF;
    DELETE FROM receipts WHERE tick < v_mark;
    GET DIAGNOSTICS v_deleted = ROW_COUNT;
    UPDATE retention SET low_water = v_mark;
    RETURN jsonb_build_object('status', 'purged', 'deleted', v_deleted, 'low_water', v_mark);
END $$;


-- === helpers: input checks (22023 before anything is written) ==============================
CREATE OR REPLACE FUNCTION article1.check_identity(p_caller text, p_key text) RETURNS void
LANGUAGE plpgsql IMMUTABLE SET search_path = article1, pg_temp AS $$
BEGIN
    IF NOT coalesce(length(p_caller) BETWEEN 1 AND 200 AND length(p_key) BETWEEN 1 AND 200,
                    false) THEN
        RAISE EXCEPTION 'caller and key must have 1 to 200 characters' USING ERRCODE = '22023';
    END IF;
END $$;

-- The claimer a claim records, or the one a reconcile's evidence is about: a process id, a
-- name of its machine and its boot, and the process's start time there in clock ticks since
-- that boot (NULL only where a row claimed under edition 1, or 1 or 2, recorded none).
-- The edition before took no start time: its check_owner() goes.
DROP FUNCTION IF EXISTS article1.check_owner(numeric, text);
CREATE OR REPLACE FUNCTION article1.check_owner(p_pid numeric, p_host text, p_started numeric)
RETURNS void
LANGUAGE plpgsql IMMUTABLE SET search_path = article1, pg_temp AS $$
BEGIN
    IF NOT coalesce(scale(p_pid) = 0 AND p_pid BETWEEN 1 AND 2147483647, false) THEN
        RAISE EXCEPTION 'owner_pid must be a process id' USING ERRCODE = '22023';
    END IF;
    IF length(p_host) NOT BETWEEN 1 AND 255 THEN
        RAISE EXCEPTION 'owner_host must have 1 to 255 characters' USING ERRCODE = '22023';
    END IF;
    IF NOT coalesce(scale(p_started) = 0 AND p_started BETWEEN 0 AND 4611686018427387904,
                    p_started IS NULL) THEN
        RAISE EXCEPTION 'owner_started must be an integer from 0 to 2^62' USING ERRCODE = '22023';
    END IF;
END $$;

-- As Python's str.strip() sees it: not only blanks but every Unicode white space.
CREATE OR REPLACE FUNCTION article1.check_reason(p_value text, p_what text) RETURNS void
LANGUAGE plpgsql IMMUTABLE SET search_path = article1, pg_temp
SET standard_conforming_strings = on AS $$
BEGIN
    IF NOT coalesce(length(p_value) <= 1000 AND p_value !~ ('^[\t\n\v\f\r\x1c-\x1f \x85\xa0'
                        '\u1680\u2000-\u200a\u2028\u2029\u202f\u205f\u3000]*$'), false) THEN
        RAISE EXCEPTION '% must be a non-empty text of at most 1000 characters', p_what
            USING ERRCODE = '22023';
    END IF;
END $$;

-- A response answers a request only with exactly its caller, key and digest and a positive
-- integer ticket_id (1.0 and 1e0 are floats, as Python reads them).  Returns it as jsonb.
CREATE OR REPLACE FUNCTION article1.response_of(p_response text, p_caller text, p_key text,
                                                p_digest text) RETURNS jsonb
LANGUAGE plpgsql IMMUTABLE SET search_path = article1, pg_temp AS $$
DECLARE
    v_text text := canonical(p_response);
    v_value jsonb;
BEGIN
    v_value := found_of('[' || v_text || ']', p_caller, p_key) -> 0;
    IF v_value ->> 'digest' IS DISTINCT FROM p_digest THEN
        RAISE EXCEPTION 'the response does not answer %/%', p_caller, p_key
            USING ERRCODE = '22023';
    END IF;
    RETURN v_value;
END $$;

-- A JSON array of the tool's responses for (caller, key), any digest: what reconcile() takes.
CREATE OR REPLACE FUNCTION article1.found_of(p_found text, p_caller text, p_key text) RETURNS jsonb
LANGUAGE plpgsql IMMUTABLE SET search_path = article1, pg_temp AS $$
DECLARE
    -- The canonical text keeps each number's lexeme: json, unlike jsonb, shows it as written.
    v_found json := canonical_json(p_found)::json;
BEGIN
    IF json_typeof(v_found) <> 'array' OR EXISTS (
        SELECT 1 FROM json_array_elements(v_found) AS e(r)
         WHERE json_typeof(r) <> 'object'
            OR ARRAY(SELECT k FROM json_object_keys(r) AS k ORDER BY k COLLATE "C")
               <> ARRAY['caller', 'digest', 'key', 'ticket_id']
            OR (r ->> 'caller', r ->> 'key') IS DISTINCT FROM (p_caller, p_key)
            OR json_typeof(r -> 'caller') <> 'string' OR json_typeof(r -> 'key') <> 'string'
            OR json_typeof(r -> 'digest') <> 'string'
            OR (r -> 'ticket_id')::text !~ '^[1-9][0-9]*$') THEN
        RAISE EXCEPTION 'a response for %/% has exactly caller, key, digest and a positive'
                        ' integer ticket_id', p_caller, p_key USING ERRCODE = '22023';
    END IF;
    RETURN v_found::jsonb;
EXCEPTION WHEN untranslatable_character THEN
    -- A \u0000 escape: PostgreSQL text cannot hold it, and no response carries one.
    RAISE EXCEPTION 'a response for %/% holds no \u0000', p_caller, p_key
        USING ERRCODE = '22023';
END $$;

-- Whether a stored payload is still what enqueue() stores: canonical text with its digest.
CREATE OR REPLACE FUNCTION article1.is_canonical(p_payload text, p_digest text) RETURNS boolean
LANGUAGE plpgsql IMMUTABLE SET search_path = article1, pg_temp AS $$
BEGIN
    RETURN canonical(p_payload) = p_payload AND digest_of(p_payload) = p_digest;
EXCEPTION WHEN invalid_parameter_value THEN
    RETURN false;
END $$;


-- === twins: identical in article1.sql and article7.sql (a test compares them) ==============
-- 规范文本与摘要：与 reliability.canonical 和 preconditions 的摘要逐字节相同。
-- Logical ticks are integers from 0 to 2^62, and nothing is acted on before it was issued.
CREATE OR REPLACE FUNCTION article1.check_ticks(p_issued_at numeric, p_now numeric) RETURNS void
LANGUAGE plpgsql IMMUTABLE SET search_path = article1, pg_temp AS $$
BEGIN
    IF NOT coalesce(scale(p_issued_at) = 0 AND scale(p_now) = 0 AND 0 <= p_issued_at
                    AND p_issued_at <= p_now AND p_now <= 4611686018427387904, false) THEN
        RAISE EXCEPTION 'ticks need integers 0 <= issued_at (%) <= now (%) <= 2^62',
            p_issued_at, p_now USING ERRCODE = '22023';
    END IF;
END $$;

-- The SHA-256 of a text's UTF-8 bytes, in hex: reliability.canonical's and preconditions'.
CREATE OR REPLACE FUNCTION article1.digest_of(p_text text) RETURNS text
LANGUAGE sql IMMUTABLE SET search_path = article1, pg_temp AS $$
    SELECT encode(sha256(convert_to(p_text, 'UTF8')), 'hex')
$$;

-- The canonical text of a JSON object, as reliability.canonical writes it: Python's json.dumps
-- with sorted keys, separators (",", ":"), ensure_ascii=False.  At most 32 levels (a scalar
-- counts) and 65536 bytes; a repeated key, NaN or an infinite number raises 22023.
CREATE OR REPLACE FUNCTION article1.canonical(p_json text) RETURNS text
LANGUAGE plpgsql IMMUTABLE SET search_path = article1, pg_temp AS $$
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
CREATE OR REPLACE FUNCTION article1.canonical_json(p_json text) RETURNS text
LANGUAGE plpgsql IMMUTABLE SET search_path = article1, pg_temp
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
CREATE OR REPLACE FUNCTION article1.canonical_string(p_token text) RETURNS text
LANGUAGE plpgsql IMMUTABLE SET search_path = article1, pg_temp
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
CREATE OR REPLACE FUNCTION article1.json_char(p_code integer) RETURNS text
LANGUAGE sql IMMUTABLE SET search_path = article1, pg_temp
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

CREATE OR REPLACE FUNCTION article1.hex_value(p_hex text) RETURNS integer
LANGUAGE sql IMMUTABLE SET search_path = article1, pg_temp AS $$
    SELECT ('x' || lpad(p_hex, 8, '0'))::bit(32)::integer
$$;

-- A canonical key's UTF-8 bytes, its escapes decoded: bytes sort as Python sorts str keys.
-- Decoded by PostgreSQL when it can, piece by piece when the key holds a \u0000.
CREATE OR REPLACE FUNCTION article1.key_order(p_key text) RETURNS bytea
LANGUAGE sql IMMUTABLE SET search_path = article1, pg_temp
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
CREATE OR REPLACE FUNCTION article1.canonical_number(p_token text) RETURNS text
LANGUAGE plpgsql IMMUTABLE SET search_path = article1, pg_temp
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
