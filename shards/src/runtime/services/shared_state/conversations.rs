//! The Responses API's conversations in Redis (issue 52, `--shared-state`):
//! every router writes its turns there too, so any router of the fleet
//! continues any chain. Per tenant: the records (`SET ... EX ttl`), their
//! order (a sorted set by creation) and sizes (a hash), evicted oldest
//! first past the tenant's byte bound in one script. What is read back is
//! input: a value too large or not a record is treated as absent.
//!
//! Key items: [`Op`], [`carry_out`].

use futures::channel::oneshot;
use redis::Connection;

use crate::logic::http::api::conversations::Conversation;
use crate::logic::http::api::responses::{previous_of, Record, MAX_CHAIN};
use crate::runtime::services::store_api::ChainError;

/// Largest record read back from Redis.
const MAX_RECORD: usize = 64 << 20;

/// One conversation operation for the shared-state thread.
pub enum Op {
    /// Keep a record.
    Put {
        /// Its tenant.
        tenant: String,
        /// Its ID.
        id: String,
        /// Unix seconds.
        created_at: u64,
        /// The record.
        record: Vec<u8>,
        /// `--responses-max-bytes-per-tenant`.
        per_tenant: u64,
        /// `--responses-ttl-days`, seconds (0: none).
        ttl_secs: u64,
        /// Told once Redis holds it (dropped: it does not).
        stored: oneshot::Sender<()>,
    },
    /// The chain ending at `id`, oldest first.
    Chain {
        /// The tenant asking.
        tenant: String,
        /// The newest response.
        id: String,
        /// Where to answer.
        reply: oneshot::Sender<Result<Vec<Vec<u8>>, ChainError>>,
    },
    /// One record.
    Get {
        /// The tenant asking.
        tenant: String,
        /// The ID.
        id: String,
        /// Where to answer.
        reply: oneshot::Sender<Option<Vec<u8>>>,
    },
    /// Delete one record; whether it was there.
    Delete {
        /// The tenant asking.
        tenant: String,
        /// The ID.
        id: String,
        /// Where to answer.
        reply: oneshot::Sender<bool>,
    },
}

impl Op {
    /// Redis is away: the reply is dropped, so the asker hears "no
    /// answer" (not "absent") and reads its own store instead.
    pub fn unavailable(self) {}
}

/// The tenant's part of every key: hex, so any tenant name is one token.
fn tenant_part(tenant: &str) -> String {
    tenant.bytes().map(|b| format!("{b:02x}")).collect()
}

fn value_prefix(tenant: &str) -> String {
    format!("hivenet:resp:{}:", tenant_part(tenant))
}

/// Keep the record, then evict the tenant's oldest past its bound.
const PUT: &str = r#"
local old = tonumber(redis.call('HGET', KEYS[3], ARGV[4]) or '0')
if tonumber(ARGV[2]) > 0 then
  redis.call('SET', KEYS[1], ARGV[1], 'EX', ARGV[2])
else
  redis.call('SET', KEYS[1], ARGV[1])
end
redis.call('ZADD', KEYS[2], ARGV[3], ARGV[4])
redis.call('HSET', KEYS[3], ARGV[4], string.len(ARGV[1]))
local total = redis.call('INCRBY', KEYS[4], string.len(ARGV[1]) - old)
local limit = tonumber(ARGV[5])
while total > limit do
  local oldest = redis.call('ZRANGE', KEYS[2], 0, 0)
  if #oldest == 0 then break end
  local n = tonumber(redis.call('HGET', KEYS[3], oldest[1]) or '0')
  redis.call('DEL', ARGV[6] .. oldest[1])
  redis.call('ZREM', KEYS[2], oldest[1])
  redis.call('HDEL', KEYS[3], oldest[1])
  total = redis.call('DECRBY', KEYS[4], n)
end
if tonumber(ARGV[2]) > 0 then
  for i = 2, 4 do redis.call('EXPIRE', KEYS[i], ARGV[2]) end
end
return total
"#;

/// Delete one record and its bookkeeping; 1 when it was there.
const DELETE: &str = r#"
local there = redis.call('DEL', KEYS[1])
local n = tonumber(redis.call('HGET', KEYS[3], ARGV[1]) or '0')
redis.call('ZREM', KEYS[2], ARGV[1])
redis.call('HDEL', KEYS[3], ARGV[1])
if n > 0 then redis.call('DECRBY', KEYS[4], n) end
return there
"#;

fn keys(tenant: &str, id: &str) -> [String; 4] {
    let t = tenant_part(tenant);
    [
        format!("hivenet:resp:{t}:{id}"),
        format!("hivenet:resp-order:{t}"),
        format!("hivenet:resp-sizes:{t}"),
        format!("hivenet:resp-bytes:{t}"),
    ]
}

/// One record as Redis holds it, within bounds.
fn read(c: &mut Connection, tenant: &str, id: &str) -> redis::RedisResult<Option<Vec<u8>>> {
    let [k, ..] = keys(tenant, id);
    let v: Option<Vec<u8>> = redis::cmd("GET").arg(&k).query(c)?;
    Ok(v.filter(|v| v.len() <= MAX_RECORD))
}

/// Carry `op` out on `c`.
pub fn carry_out(c: &mut Connection, op: Op) -> redis::RedisResult<()> {
    match op {
        Op::Put {
            tenant,
            id,
            created_at,
            record,
            per_tenant,
            ttl_secs,
            stored,
        } => {
            let [k1, k2, k3, k4] = keys(&tenant, &id);
            let _: i64 = redis::Script::new(PUT)
                .key(k1)
                .key(k2)
                .key(k3)
                .key(k4)
                .arg(record)
                .arg(ttl_secs)
                .arg(created_at)
                .arg(&id)
                .arg(per_tenant)
                .arg(value_prefix(&tenant))
                .invoke(c)?;
            let _ = stored.send(());
        }
        Op::Get { tenant, id, reply } => {
            let v = read(c, &tenant, &id)?;
            // A conversation (the Conversations API) or a response.
            let v = v.filter(
                |v| match crate::logic::http::api::conversations::is_id(&id) {
                    true => serde_json::from_slice::<Conversation>(v).is_ok(),
                    false => serde_json::from_slice::<Record>(v).is_ok(),
                },
            );
            let _ = reply.send(v);
        }
        Op::Delete { tenant, id, reply } => {
            let [k1, k2, k3, k4] = keys(&tenant, &id);
            let n: i64 = redis::Script::new(DELETE)
                .key(k1)
                .key(k2)
                .key(k3)
                .key(k4)
                .arg(&id)
                .invoke(c)?;
            let _ = reply.send(n > 0);
        }
        Op::Chain { tenant, id, reply } => {
            let mut out = Vec::new();
            let mut seen = std::collections::HashSet::new();
            let mut next = Some(id);
            let answer = loop {
                let Some(id) = next.take() else {
                    out.reverse();
                    break Ok(out);
                };
                if out.len() >= MAX_CHAIN || !seen.insert(id.clone()) {
                    break Err(ChainError::TooLong(MAX_CHAIN));
                }
                let raw = read(c, &tenant, &id)?;
                let Some(prev) = raw.as_deref().and_then(|v| previous_of(v).ok()) else {
                    break Err(ChainError::NotFound(id));
                };
                next = prev;
                out.extend(raw);
            };
            let _ = reply.send(answer);
        }
    }
    Ok(())
}
