//! The `k3` binary: everything lives in the library; this only sets the exit status.

fn main() {
    std::process::exit(k3::cli::main());
}
