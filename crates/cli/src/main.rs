//! `entrollm`: the command line of [`entrollm::Cli`].

use entrollm::{build_pool, execute, Cli};

fn main() {
    let cli = Cli::parse_args(std::env::args_os()).unwrap_or_else(|e| e.exit());
    // Die quietly when stdout is a closed pipe (`entrollm inspect … | head`), like other CLI
    // tools, instead of panicking in println!. Not the server: a client that leaves must not end
    // it (a closed socket is an error on that connection only).
    // SAFETY: restores the default disposition of one signal before any thread starts.
    #[cfg(unix)]
    if !cli.is_server() {
        unsafe {
            libc::signal(libc::SIGPIPE, libc::SIG_DFL);
        }
    }
    // SIGINT/SIGTERM: the partial output of the command in flight is removed, then the process
    // exits as the signal would have ended it (SIGKILL's leftovers go on the next run beside the
    // same output). The server handles them itself: it finishes its answers first.
    #[cfg(unix)]
    if !cli.is_server() {
        if let Ok(mut signals) = signal_hook::iterator::Signals::new([
            signal_hook::consts::SIGINT,
            signal_hook::consts::SIGTERM,
        ]) {
            std::thread::spawn(move || {
                if let Some(sig) = signals.forever().next() {
                    if entrollm_format::remove_live() > 0 {
                        eprintln!("\ninterrupted: the partial output was removed");
                    }
                    std::process::exit(128 + sig);
                }
            });
        }
    }
    let result = build_pool(cli.threads).and_then(|()| execute(cli.command));
    if let Err(e) = result {
        eprintln!("error: {e:#}");
        std::process::exit(1);
    }
}
