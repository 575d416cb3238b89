//! A bounded pool of scoped threads over a list of jobs: each thread takes the next job, the
//! first error stops the others from starting new ones. Results come back in job order.

use crate::error::Result;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::Mutex;

/// Runs `work(job, scratch)` for every job on `threads` threads (each with its own scratch).
pub(crate) fn run<J: Sync, T: Send, S>(
    threads: usize,
    jobs: &[J],
    scratch: impl Fn() -> S + Sync,
    work: impl Fn(&J, &mut S) -> Result<T> + Sync,
) -> Result<Vec<T>> {
    let next = AtomicUsize::new(0);
    let failed = AtomicBool::new(false);
    let results: Mutex<Vec<Option<T>>> = Mutex::new(jobs.iter().map(|_| None).collect());
    let first_error = Mutex::new(None);
    std::thread::scope(|s| {
        for _ in 0..threads.clamp(1, jobs.len().max(1)) {
            s.spawn(|| {
                let mut scratch = scratch();
                loop {
                    if failed.load(Ordering::Relaxed) {
                        return;
                    }
                    let i = next.fetch_add(1, Ordering::Relaxed);
                    let Some(job) = jobs.get(i) else { return };
                    match work(job, &mut scratch) {
                        Ok(t) => results.lock().expect("results lock")[i] = Some(t),
                        Err(e) => {
                            failed.store(true, Ordering::Relaxed);
                            first_error.lock().expect("error lock").get_or_insert(e);
                            return;
                        }
                    }
                }
            });
        }
    });
    if let Some(e) = first_error.into_inner().expect("error lock") {
        return Err(e);
    }
    Ok(results
        .into_inner()
        .expect("results lock")
        .into_iter()
        .map(|r| r.expect("every job ran"))
        .collect())
}
