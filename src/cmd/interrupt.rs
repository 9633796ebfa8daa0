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
//! - While the process waits for input ([`Mode::Idle`], the chat prompt) or
//!   has nothing to lose yet (loading the model) a Ctrl-C ends it at once,
//!   as in llama.cpp's interactive mode.
//! - [`Mode::Passive`]: another handler (the server's) acts on the signal;
//!   this one does nothing.
//!
//! The handler is installed at a command's start, before the model loads:
//! a shell starts a background job with SIGINT ignored, and a Ctrl-C (or
//! `kill -INT`) that comes before the handler is in place is lost.
//! [`install_term`] gives SIGTERM the same handling, for commands whose
//! unfinished output must be removed (`kvrun synth`).

use std::sync::atomic::{AtomicBool, AtomicI32, AtomicU32, AtomicU8, Ordering};

/// The exit status after Ctrl-C (128 + SIGINT), as shells and llama.cpp use.
pub const EXIT_CODE: u8 = 130;

/// Ctrl-C presses since the last [`clear`].
static PRESSES: AtomicU32 = AtomicU32::new(0);
/// The [`Mode`] in force, as its `u8`.
static MODE: AtomicU8 = AtomicU8::new(Mode::Busy as u8);
/// The last signal handled (SIGINT unless SIGTERM came).
static SIGNAL: AtomicI32 = AtomicI32::new(libc::SIGINT);
static INSTALLED: AtomicBool = AtomicBool::new(false);
static INSTALLED_TERM: AtomicBool = AtomicBool::new(false);

/// What the process is doing, which decides what a Ctrl-C does.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[repr(u8)]
pub enum Mode {
    /// Working: the first Ctrl-C asks the command to stop, the second kills.
    Busy = 0,
    /// Waiting for input, or nothing done yet: a Ctrl-C ends the process.
    Idle = 1,
    /// Another handler acts on the signal (the server's own, which calls
    /// this one too): nothing happens here.
    Passive = 2,
}

extern "C" fn on_signal(sig: libc::c_int) {
    let mode = MODE.load(Ordering::SeqCst);
    if mode == Mode::Passive as u8 {
        return;
    }
    SIGNAL.store(sig, Ordering::SeqCst);
    let before = PRESSES.fetch_add(1, Ordering::SeqCst);
    if mode == Mode::Idle as u8 || before >= 1 {
        // SAFETY: write(2) and _exit(2) are async-signal-safe; the buffer is
        // a static byte string.
        unsafe {
            libc::write(2, b"\n".as_ptr().cast(), 1);
            libc::_exit(128 + sig);
        }
    }
}

/// Put `on_signal` in place for `sig`.
fn handle(sig: libc::c_int) {
    // SAFETY: the sigaction struct is zero-initialised and then filled with
    // a handler of the C signature sigaction expects for a non-SA_SIGINFO
    // handler; no flags, so a blocking read(2) returns EINTR (std retries it).
    unsafe {
        let mut sa: libc::sigaction = std::mem::zeroed();
        sa.sa_sigaction = on_signal as extern "C" fn(libc::c_int) as usize;
        libc::sigemptyset(&mut sa.sa_mask);
        libc::sigaction(sig, &sa, std::ptr::null_mut());
    }
}

/// Install the SIGINT handler (once; later calls do nothing).
pub fn install() {
    if !INSTALLED.swap(true, Ordering::SeqCst) {
        handle(libc::SIGINT);
    }
}

/// [`install`], and handle SIGTERM the same way (once).
pub fn install_term() {
    install();
    if !INSTALLED_TERM.swap(true, Ordering::SeqCst) {
        handle(libc::SIGTERM);
    }
}

/// The exit status for [`crate::error::Error::Interrupted`]: 128 + the
/// signal that stopped the command (130 for Ctrl-C, 143 for SIGTERM).
pub fn exit_code() -> u8 {
    u8::try_from(128 + SIGNAL.load(Ordering::SeqCst)).unwrap_or(EXIT_CODE)
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
    MODE.store(mode as u8, Ordering::SeqCst);
}

/// `Err(Interrupted)` when Ctrl-C was pressed: for loops over records.
pub fn check() -> crate::error::Result<()> {
    if requested() {
        Err(crate::error::Error::Interrupted)
    } else {
        Ok(())
    }
}
