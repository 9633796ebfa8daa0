//! The `kvrun` binary: parse the command line, run, and turn any error into
//! one line on stderr and a non-zero exit code.

use std::process::ExitCode;

fn main() -> ExitCode {
    // A bug must still end in one readable line, not a backtrace.
    std::panic::set_hook(Box::new(|info| {
        eprintln!("error: internal error: {info}");
    }));
    let cli = match kvrun::cmd::parse(std::env::args_os()) {
        Ok(c) => c,
        Err(e) if e.use_stderr() => {
            // bad input: one line, as for every other error
            eprintln!("{}", kvrun::cmd::one_line(&e));
            return ExitCode::from(2);
        }
        Err(e) => {
            // --help, --version
            let _ = e.print();
            return ExitCode::SUCCESS;
        }
    };
    match kvrun::backend::cpu::isa::check_env() {
        Err(e) => {
            eprintln!("error: {e}");
            return ExitCode::FAILURE;
        }
        Ok(_) if kvrun::backend::cpu::isa::level_is_emulated() => {
            eprintln!("kvrun: warning: the AMX tiles are emulated in software (KVRUN_AMX_EMULATE=1): correct but slow, for testing");
        }
        Ok(_) => {}
    }
    match kvrun::cmd::run(cli) {
        Ok(()) => ExitCode::SUCCESS,
        // what was finished is already written and reported
        Err(kvrun::error::Error::Interrupted) => ExitCode::from(kvrun::cmd::interrupt::exit_code()),
        Err(e) => {
            eprintln!("error: {e}");
            ExitCode::FAILURE
        }
    }
}
