//! The web chat `kvrun serve` answers at `/`: three static files compiled
//! into the binary (`web/index.html`, `web/app.js`, `web/style.css`; plain
//! HTML/JS/CSS, no build step, nothing fetched from elsewhere). The page
//! talks to the server's own endpoints only: `/props` (model, the policy
//! table and the KV defaults), `/v1/chat/completions` (streamed, with the
//! per-request `policy` / `kv_budget` fields and `stream_options.
//! include_usage` for the stats), `/slots?cached=1` (which tokens of the
//! conversation the slot still caches). The files are public (they hold no
//! data); with `--api-key` the page sends the key the user types.

use axum::http::{header, HeaderValue};
use axum::response::{IntoResponse, Response};

const INDEX: &str = include_str!("web/index.html");
const APP_JS: &str = include_str!("web/app.js");
const STYLE: &str = include_str!("web/style.css");

/// The paths of the static files (open even with `--api-key`).
pub(super) const PATHS: &[&str] = &["/", "/index.html", "/app.js", "/style.css"];

fn file(body: &'static str, mime: &'static str) -> Response {
    let mut r = body.into_response();
    let h = r.headers_mut();
    h.insert(header::CONTENT_TYPE, HeaderValue::from_static(mime));
    h.insert(header::CACHE_CONTROL, HeaderValue::from_static("no-cache"));
    r
}

/// `GET /` and `GET /index.html`.
pub(super) async fn index() -> Response {
    file(INDEX, "text/html; charset=utf-8")
}

/// `GET /app.js`.
pub(super) async fn app_js() -> Response {
    file(APP_JS, "text/javascript; charset=utf-8")
}

/// `GET /style.css`.
pub(super) async fn style() -> Response {
    file(STYLE, "text/css; charset=utf-8")
}
