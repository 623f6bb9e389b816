//! The CPU engine's fork-join. A decode step is some two hundred small parallel products (a few
//! microseconds each on a small model); rayon's machinery for one (tasks injected into queues,
//! stolen, latches set, sleeping threads woken) cost a tenth or more of the step. So while an
//! [`Awake`] lives (an engine's forward), the pool's other threads stay awake polling one job
//! slot, and [`chunks_mut`] called by the thread that made it publishes the job there: every
//! thread, the publisher too, claims the job's tasks one compare-and-swap at a time until none
//! are left, and the publisher waits for the last to finish. Anywhere else [`chunks_mut`] is
//! rayon's `par_chunks_mut`, so callers need not know which runs them.

use rayon::prelude::*;
use std::cell::Cell;
use std::sync::atomic::{AtomicBool, AtomicPtr, AtomicU64, AtomicUsize, Ordering::SeqCst};
use std::sync::{Arc, Mutex};

/// `f(i, chunk)` for each `chunk`-element piece of `out` (the last may be shorter), in parallel.
pub(crate) fn chunks_mut<T: Send>(out: &mut [T], chunk: usize, f: impl Fn(usize, &mut [T]) + Sync) {
    assert!(chunk > 0, "chunk size 0");
    let tasks = out.len().div_ceil(chunk);
    if tasks <= 1 {
        if !out.is_empty() {
            f(0, out);
        }
        return;
    }
    if !LEADING.get() || tasks as u64 > TASKS {
        return out
            .par_chunks_mut(chunk)
            .enumerate()
            .for_each(|(i, c)| f(i, c));
    }
    let (base, len) = (SendPtr(out.as_mut_ptr()), out.len());
    let task = move |i: usize| {
        let start = i * chunk;
        let base = &base;
        // SAFETY: tasks `i` are distinct and below `tasks`, so their ranges are disjoint pieces
        // of `out`, which the caller lends exclusively until `run` returns (after every task).
        let piece =
            unsafe { std::slice::from_raw_parts_mut(base.0.add(start), chunk.min(len - start)) };
        f(i, piece)
    };
    SLOT.run(tasks, &task);
}

struct SendPtr<T>(*mut T);
// SAFETY: the pointer is only turned into disjoint slices, one per task (see `chunks_mut`).
unsafe impl<T: Send> Send for SendPtr<T> {}
unsafe impl<T: Send> Sync for SendPtr<T> {}

/// Whether [`chunks_mut`] on this thread now goes to the crew (an [`Awake`] made here lives and
/// this is not one of its tasks).
pub(crate) fn leading() -> bool {
    LEADING.get()
}

/// The job the threads claim tasks of. One exists (one [`Awake`] at a time).
struct Slot {
    /// The job's generation (bits 40–63), its task count (bits 20–39) and its next unclaimed
    /// task (bits 0–19). A claim is a compare-and-swap of all three, so a thread cannot claim a
    /// task of a job other than the one whose state it read, nor past its count.
    state: AtomicU64,
    /// The current job: a pointer to a `&(dyn Fn(usize) + Sync)` on the publisher's stack,
    /// dereferenced only after a successful claim (the publisher is then still waiting). Written
    /// before the state that publishes it and replaced only once all its tasks are claimed.
    job: AtomicPtr<()>,
    /// Tasks of the current job finished.
    done: AtomicUsize,
    /// A task's panic, carried to the publisher once every task has finished.
    panic: Mutex<Option<Box<dyn std::any::Any + Send>>>,
}

/// Bits of the task count and of the next task in [`Slot::state`].
const TASK_BITS: u32 = 20;
const TASKS: u64 = (1 << TASK_BITS) - 1;

type Job<'a> = &'a (dyn Fn(usize) + Sync);

static SLOT: Slot = Slot {
    state: AtomicU64::new(0),
    job: AtomicPtr::new(std::ptr::null_mut()),
    done: AtomicUsize::new(0),
    panic: Mutex::new(None),
};

thread_local! {
    /// Whether this thread made the live [`Awake`] and is not inside one of its tasks.
    static LEADING: Cell<bool> = const { Cell::new(false) };
    /// Whether this thread polls the slot for an [`Awake`].
    static SPINNING: Cell<bool> = const { Cell::new(false) };
}

impl Slot {
    /// Publishes `tasks` tasks of `job`, takes part, and returns once all have finished
    /// (resuming a task's panic).
    fn run(&self, tasks: usize, job: Job) {
        debug_assert!(tasks as u64 <= TASKS, "{tasks} tasks in one job");
        LEADING.set(false);
        self.done.store(0, SeqCst);
        self.job.store(&job as *const Job as *mut (), SeqCst);
        let generation = (self.state.load(SeqCst) >> (2 * TASK_BITS)) + 1;
        let state = (generation << (2 * TASK_BITS)) | ((tasks as u64) << TASK_BITS);
        self.state.store(state, SeqCst);
        while self.work_one() {}
        while self.done.load(SeqCst) < tasks {
            std::hint::spin_loop();
        }
        LEADING.set(true);
        if let Some(p) = self.panic.lock().unwrap_or_else(|e| e.into_inner()).take() {
            std::panic::resume_unwind(p);
        }
    }

    /// Claims and runs one task of the current job; false when none is left.
    fn work_one(&self) -> bool {
        loop {
            let s = self.state.load(SeqCst);
            let job = self.job.load(SeqCst);
            let (count, next) = ((s >> TASK_BITS) & TASKS, s & TASKS);
            if next >= count {
                return false;
            }
            if self
                .state
                .compare_exchange(s, s + 1, SeqCst, SeqCst)
                .is_ok()
            {
                // SAFETY: the claim succeeded, so the job of state `s` still had an unclaimed
                // task after `job` was read: `job` is that job's (written before `s` was
                // published, replaced only once all its tasks are claimed), and its publisher
                // waits in `run` for this task, keeping it alive.
                let job: Job = unsafe { *(job as *const Job) };
                let r =
                    std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| job(next as usize)));
                if let Err(p) = r {
                    *self.panic.lock().unwrap_or_else(|e| e.into_inner()) = Some(p);
                }
                self.done.fetch_add(1, SeqCst);
                return true;
            }
        }
    }
}

/// While it lives, the pool's other threads poll the slot (and rayon's queues) instead of
/// sleeping, and [`chunks_mut`] on this thread uses the slot. Only from inside the pool (the CLI
/// runs its decode loops there), one at a time, with no more threads than cores; elsewhere `new`
/// gives `None` and everything runs on rayon.
///
/// A spinning thread also runs the pool's tasks through `rayon::yield_now`, so it must start at
/// the top of its thread: one started beneath a waiting task would hold that task until the
/// step ends, and the step waits for the task. So `new` waits (briefly) for every spinner to
/// start before the step queues any task, and a spinner started later, or beneath another,
/// returns.
pub(crate) struct Awake {
    shared: Arc<AwakeState>,
}

struct AwakeState {
    stop: AtomicBool,
    started: AtomicUsize,
}

/// Whether an [`Awake`] lives (one at a time).
static AWAKE: AtomicBool = AtomicBool::new(false);

impl Awake {
    /// How long `new` waits for the other threads to start spinning (a sleeping thread's wake).
    const START_WAIT: std::time::Duration = std::time::Duration::from_millis(1);
    /// Polls of the slot between looks at rayon's queues (those cost a hundred nanoseconds).
    const POLLS: usize = 64;

    pub(crate) fn new() -> Option<Awake> {
        let me = rayon::current_thread_index()?;
        let threads = rayon::current_num_threads();
        let others = threads - 1;
        // More threads than cores: a spinner would take a core from a thread with work. (Asked
        // once: the answer reads the affinity mask and cgroup files.)
        static CORES: std::sync::OnceLock<usize> = std::sync::OnceLock::new();
        let cores =
            *CORES.get_or_init(|| std::thread::available_parallelism().map_or(1, |n| n.get()));
        if others == 0 || threads > cores || AWAKE.swap(true, SeqCst) {
            return None;
        }
        let shared = Arc::new(AwakeState {
            stop: AtomicBool::new(false),
            started: AtomicUsize::new(0),
        });
        let state = Arc::clone(&shared);
        rayon::spawn_broadcast(move |ctx| {
            if ctx.index() == me || SPINNING.get() {
                return;
            }
            state.started.fetch_add(1, SeqCst);
            SPINNING.set(true);
            while !state.stop.load(SeqCst) {
                let mut worked = false;
                for _ in 0..Self::POLLS {
                    if SLOT.work_one() {
                        worked = true;
                        break;
                    }
                    std::hint::spin_loop();
                }
                if !worked {
                    rayon::yield_now();
                }
            }
            SPINNING.set(false);
        });
        let awake = Awake { shared };
        let t0 = std::time::Instant::now();
        while awake.shared.started.load(SeqCst) < others {
            if t0.elapsed() > Self::START_WAIT {
                // Dropped: those that started stop, later ones return at once.
                return None;
            }
            std::hint::spin_loop();
        }
        LEADING.set(true);
        Some(awake)
    }
}

impl Drop for Awake {
    fn drop(&mut self) {
        LEADING.set(false);
        self.shared.stop.store(true, SeqCst);
        AWAKE.store(false, SeqCst);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Every piece written once, by index, whether the slot or rayon runs them; nested calls and
    /// many small jobs in a row (a stale claim would write a piece twice or skip one).
    #[test]
    fn every_piece_is_done_once_in_and_out_of_an_awake() {
        let pool = rayon::ThreadPoolBuilder::new()
            .num_threads(2)
            .build()
            .unwrap();
        pool.install(|| {
            for awake in [false, true] {
                // Two threads on two or more cores: the slot runs the jobs (its threads may be
                // slow to start on a busy machine: asked again).
                let a = awake
                    .then(|| (0..1000).find_map(|_| Awake::new()))
                    .flatten();
                let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
                assert_eq!(a.is_some(), awake && cores >= 2);
                assert_eq!(leading(), a.is_some());
                for round in 0..2000usize {
                    let len = 1 + round % 97;
                    let chunk = 1 + round % 7;
                    let mut out = vec![0usize; len];
                    chunks_mut(&mut out, chunk, |i, piece| {
                        let mut inner = vec![0u8; 9];
                        chunks_mut(&mut inner, 2, |_, p| p.fill(1));
                        assert!(inner.iter().all(|&b| b == 1));
                        for (j, v) in piece.iter_mut().enumerate() {
                            *v += i * chunk + j + 1;
                        }
                    });
                    assert!(out.iter().enumerate().all(|(j, &v)| v == j + 1), "{round}");
                }
            }
        });
    }

    /// A task's panic reaches the caller once every task has finished; the slot works after.
    #[test]
    fn a_panicking_task_panics_the_caller_and_the_slot_goes_on() {
        let pool = rayon::ThreadPoolBuilder::new()
            .num_threads(2)
            .build()
            .unwrap();
        pool.install(|| {
            let _a = Awake::new();
            let mut out = vec![0u32; 64];
            let r = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
                chunks_mut(&mut out, 4, |i, _| assert!(i != 5, "task five"))
            }));
            assert!(r.is_err());
            chunks_mut(&mut out, 4, |_, p| p.fill(7));
            assert!(out.iter().all(|&v| v == 7));
        });
    }
}
