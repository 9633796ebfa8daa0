//! Ctrl-C the way llama.cpp users expect it, for the commands that run in
//! the foreground (one-shot generation, `chat`, `batch`, `eval`).
//!
//! [`install`] puts a SIGINT handler in place (the server keeps tokio's own
//! signal handling instead). The handler only touches atomics and, when the
//! process must end at once, writes a newline and calls `_exit`, all of which
//! are async-signal-safe:
//!
//! - While work runs ([`Mode::Busy`]) the first Ctrl-C only raises a flag:
//!   the command polls [`requested`], stops at the next token or record,
//!   saves and reports what it finished, and exits with [`EXIT_CODE`]
//!   (through [`crate::error::Error::Interrupted`]).
//! - A second Ctrl-C before the command has reacted (say, in the middle of a
//!   long prefill) ends the process at once with [`EXIT_CODE`]; everything
//!   already finished was written whole (records are flushed one by one).
//! - While the process waits for input ([`Mode::Idle`], the chat prompt) a
//!   Ctrl-C ends it at once, as in llama.cpp's interactive mode.

use std::sync::atomic::{AtomicBool, AtomicU32, Ordering};

/// The exit status after Ctrl-C (128 + SIGINT), as shells and llama.cpp use.
pub const EXIT_CODE: u8 = 130;

/// Ctrl-C presses since the last [`clear`].
static PRESSES: AtomicU32 = AtomicU32::new(0);
/// True while the process waits for user input.
static IDLE: AtomicBool = AtomicBool::new(false);
static INSTALLED: AtomicBool = AtomicBool::new(false);

/// What the process is doing, which decides what a Ctrl-C does.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Mode {
    /// Working: the first Ctrl-C asks the command to stop, the second kills.
    Busy,
    /// Waiting for input: a Ctrl-C ends the process.
    Idle,
}

extern "C" fn on_sigint(_sig: libc::c_int) {
    let before = PRESSES.fetch_add(1, Ordering::SeqCst);
    if IDLE.load(Ordering::SeqCst) || before >= 1 {
        // SAFETY: write(2) and _exit(2) are async-signal-safe; the buffer is
        // a static byte string.
        unsafe {
            libc::write(2, b"\n".as_ptr().cast(), 1);
            libc::_exit(EXIT_CODE as libc::c_int);
        }
    }
}

/// Install the SIGINT handler (once; later calls do nothing).
pub fn install() {
    if INSTALLED.swap(true, Ordering::SeqCst) {
        return;
    }
    // SAFETY: the sigaction struct is zero-initialised and then filled with
    // a handler of the C signature sigaction expects for a non-SA_SIGINFO
    // handler; no flags, so a blocking read(2) returns EINTR (std retries it).
    unsafe {
        let mut sa: libc::sigaction = std::mem::zeroed();
        sa.sa_sigaction = on_sigint as extern "C" fn(libc::c_int) as usize;
        libc::sigemptyset(&mut sa.sa_mask);
        libc::sigaction(libc::SIGINT, &sa, std::ptr::null_mut());
    }
}

/// Whether Ctrl-C was pressed since the last [`clear`].
pub fn requested() -> bool {
    PRESSES.load(Ordering::SeqCst) > 0
}

/// Forget earlier presses (chat, after a stopped reply).
pub fn clear() {
    PRESSES.store(0, Ordering::SeqCst);
}

/// Say whether the process is working or waiting for input.
pub fn set_mode(mode: Mode) {
    IDLE.store(mode == Mode::Idle, Ordering::SeqCst);
}

/// `Err(Interrupted)` when Ctrl-C was pressed: for loops over records.
pub fn check() -> crate::error::Result<()> {
    if requested() {
        Err(crate::error::Error::Interrupted)
    } else {
        Ok(())
    }
}
