//! The routes of the state the router keeps for its clients (issue 52):
//! the Responses API's stored responses (`/v1/responses/{id}...`) and the
//! Conversations API (`/v1/conversations...`), authenticated like
//! inference; their logic is in [`crate::runtime::request::responses`]
//! and [`crate::runtime::request::conversations`].

use std::rc::Rc;

use super::placing::Next;
use super::reading::{authenticate, read_body};
use crate::logic::http::framing::http_parse::{BodyFraming, RequestHead};
use crate::runtime::state::scope::Client;
use crate::runtime::state::shard::Shard;

/// Whether `path` is one of these routes (checked before [`api`] is
/// boxed: other routes pay nothing).
pub(super) fn is_path(path: &str) -> bool {
    use crate::runtime::request::{conversations, responses};
    conversations::is_api_path(path) || responses::is_api_path(path)
}

/// The state the router keeps for the Responses and Conversations APIs
/// (`/v1/responses/{id}...`, `/v1/conversations...`; [`is_path`]).
pub(super) async fn api(shard: &Rc<Shard>, c: &mut Client, head: &RequestHead, path: &str) -> Next {
    use crate::runtime::request::{conversations, responses};
    // A body not read closes the connection after a refusal.
    let keep = head.keep_alive && head.framing == BodyFraming::None;
    let p = match authenticate(shard, c, head, keep).await {
        Ok(p) => p,
        Err(k) => return k.into(),
    };
    let method = head.method.to_string();
    if !conversations::is_api_path(path) {
        return responses::serve_api(shard, c, &p, &method, path, keep)
            .await
            .into();
    }
    let body = match head.framing {
        BodyFraming::None => Vec::new(),
        _ => match read_body(shard, c, head).await {
            Ok((b, _permit)) => b,
            Err(next) => return next,
        },
    };
    let query = head.path.as_str().split_once('?').map_or("", |(_, q)| q);
    let keep = head.keep_alive;
    let done = conversations::serve_api(shard, c, &p, &method, path, query, &body, keep);
    done.await.into()
}
