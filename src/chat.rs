//! Chat templates (in progress).
