//! Progress bars for long work (hidden when stderr is not a terminal).

use indicatif::{ProgressBar, ProgressStyle};

/// A bar over `total` bytes with a message.
pub fn bytes(total: u64, msg: &str) -> ProgressBar {
    let bar = ProgressBar::new(total);
    bar.set_style(
        ProgressStyle::with_template(
            "{msg:>12} [{elapsed_precise}] {wide_bar} {binary_bytes}/{binary_total_bytes} ({binary_bytes_per_sec}, {eta})",
        )
        .expect("the template is valid"),
    );
    bar.set_message(msg.to_string());
    bar
}

/// A bar over `total` steps (e.g. layers) with a message.
pub fn steps(total: u64, msg: &str) -> ProgressBar {
    let bar = ProgressBar::new(total);
    bar.set_style(
        ProgressStyle::with_template(
            "{msg:>12} [{elapsed_precise}] {wide_bar} {pos}/{len} ({eta})",
        )
        .expect("the template is valid"),
    );
    bar.set_message(msg.to_string());
    bar
}
