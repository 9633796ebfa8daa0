//! Streaming responses of `kvrun serve` (`"stream": true`): server-sent
//! events, one `data:` line per chunk, ending in `data: [DONE]`.

use super::api::{extras, usage, Endpoint, Ev, RespCtx};
use axum::response::sse::{Event, Sse};
use axum::response::{IntoResponse, Response};
use futures_util::stream::{self, StreamExt};
use serde_json::json;
use std::convert::Infallible;
use std::sync::Arc;
use tokio::sync::mpsc::UnboundedReceiver;
use tokio_stream::wrappers::UnboundedReceiverStream;

/// The SSE response: the chat role chunk first, then one chunk per worker
/// event until the worker is done.
pub(super) fn stream_response(ctx: Arc<RespCtx>, rx: UnboundedReceiver<Ev>) -> Response {
    let head = if ctx.ep == Endpoint::Chat {
        vec![ctx.chunk(json!({"role": "assistant", "content": ""}), None, None)]
    } else {
        Vec::new()
    };
    let body = stream::iter(head)
        .chain(UnboundedReceiverStream::new(rx).flat_map(move |ev| stream::iter(ctx.events(ev))))
        .map(|data| Ok::<Event, Infallible>(Event::default().data(data)));
    Sse::new(body).into_response()
}

impl RespCtx {
    /// SSE data lines for one worker event.
    pub(super) fn events(&self, ev: Ev) -> Vec<String> {
        match ev {
            Ev::Started => Vec::new(),
            Ev::Delta {
                reasoning,
                text,
                logprobs,
            } => {
                let key = if reasoning {
                    "reasoning_content"
                } else {
                    "content"
                };
                vec![self.chunk(json!({ key: text }), Some(&logprobs), None)]
            }
            Ev::Done(d) => {
                let mut out = vec![self.chunk(json!({}), None, Some(d.finish))];
                if self.include_usage {
                    let (timings, kv) = extras(&d);
                    out.push(
                        json!({
                            "id": self.id,
                            "object": self.object(true),
                            "created": self.created,
                            "model": self.model,
                            "choices": [],
                            "usage": usage(&d),
                            "timings": timings,
                            "kv": kv,
                        })
                        .to_string(),
                    );
                }
                out.push("[DONE]".into());
                out
            }
            Ev::Error(e) => vec![e.body().to_string()],
        }
    }
}
