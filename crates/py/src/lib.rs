//! `entrollm._native`: the command line (`entrollm::Cli`) callable from Python, one command a
//! call, in the calling process. The Python package (`python/entrollm`) turns keyword arguments
//! into the command's flags, so a function does what the command does, bit for bit, with its
//! messages and progress bars; an error is a Python exception carrying the command's message.

use pyo3::create_exception;
use pyo3::exceptions::PyRuntimeError;
use pyo3::prelude::*;
use std::sync::Once;

mod container;
mod engine;
mod forms;

create_exception!(
    _native,
    EntrollmError,
    PyRuntimeError,
    "A command of entrollm failed; the message is the command line's."
);

/// Runs `entrollm ARGS…` (without the program name). Raises `EntrollmError` with the command's
/// message where it fails, `ValueError` with clap's usage message where the arguments are wrong.
#[pyfunction]
fn cli(py: Python<'_>, args: Vec<String>) -> PyResult<()> {
    let argv = std::iter::once("entrollm".to_string()).chain(args);
    let parsed = match entrollm::Cli::parse_args(argv) {
        Ok(c) => c,
        Err(e) => {
            use pyo3::exceptions::PyValueError;
            // --help and --version are not errors: print them as the binary does.
            if !e.use_stderr() {
                let _ = e.print();
                return Ok(());
            }
            return Err(PyValueError::new_err(e.render().to_string()));
        }
    };
    if parsed.is_server() {
        return Err(EntrollmError::new_err(
            "serve: run the server as its own process (`entrollm serve …` or `python -m entrollm \
             serve …`); from Python, call it through subprocess",
        ));
    }
    pool(parsed.threads)?;
    py.detach(|| entrollm::execute(parsed.command))
        .map_err(|e| EntrollmError::new_err(format!("{e:#}")))
}

/// The worker pool, built once a process: its size is the first call's `threads` (or every
/// core); a later call that asks for a different size is refused rather than silently ignored.
pub(crate) fn pool(threads: Option<usize>) -> PyResult<()> {
    static BUILT: Once = Once::new();
    let mut result = Ok(());
    BUILT.call_once(|| result = entrollm::build_pool(threads));
    result.map_err(|e| EntrollmError::new_err(format!("{e:#}")))?;
    if let Some(n) = threads {
        let have = entrollm::pool_threads();
        if n != have {
            return Err(EntrollmError::new_err(format!(
                "threads={n}: this process's worker pool has {have} threads, set by its first \
                 entrollm call; give threads on the first call"
            )));
        }
    }
    Ok(())
}

#[pymodule]
fn _native(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_function(wrap_pyfunction!(cli, m)?)?;
    m.add_class::<forms::Matrix>()?;
    m.add_class::<container::Container>()?;
    m.add_class::<engine::Tokenizer>()?;
    m.add_function(wrap_pyfunction!(engine::engine_model, m)?)?;
    m.add_function(wrap_pyfunction!(forms::variants, m)?)?;
    m.add_function(wrap_pyfunction!(forms::form_names, m)?)?;
    m.add("EntrollmError", m.py().get_type::<EntrollmError>())?;
    m.add("__version__", env!("CARGO_PKG_VERSION"))?;
    Ok(())
}
