//! A meeting of threads that lend borrows: each of `n` seats calls [`Meeting::meet`] with a
//! reference it holds for the length of the call; the last to arrive runs one function over
//! every seat's reference while the others wait, and every seat returns the result.
//!
//! This is how one thread per GPU drives a set of GPUs that one object queues work for (as
//! NCCL's communicators of one process, one thread each): each thread lends its view of the
//! caller's buffer and stream, the last queues the collective on every stream. The borrows
//! cross threads, which safe Rust cannot say; this module is the one place that does, and the
//! rule that makes it sound is simple: a seat's reference is used only while that seat's
//! thread is blocked inside `meet`, and a thread leaves `meet` only when the run that used its
//! reference has finished, or when it has taken its reference back before any run began.
//!
//! Waiting blocks on a condition variable (no spinning), to a deadline. A seat that times out
//! breaks the meeting (the other seats leave at once with the reason, and every later meeting
//! fails the same way): the collective it was part of can never be whole.
//!
//! A seat that cannot take part in a meeting (its call was refused before it could lend
//! anything) **cancels** it ([`Meeting::cancel`]) instead: every seat's call of that meeting
//! fails with the reason ([`MeetError::Cancelled`]), those waiting at once, those still to come
//! when they arrive; nothing runs, and the next meeting is whole again. A cancellation no other
//! seat has seen can be taken back ([`Meeting::settle`]).

use std::sync::{Condvar, Mutex, MutexGuard};

use crate::Deadline;

/// Why a seat left a meeting without a result.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum MeetError {
    /// The meeting was broken (by [`Meeting::break_with`], a seat's timeout, or a run that
    /// panicked): the reason.
    #[error("{0}")]
    Broken(String),
    /// This seat waited past its deadline for the others (the meeting is broken now).
    #[error("the other seats did not arrive in time")]
    Timeout,
    /// The seat does not exist, or is taken by a call still in the meeting.
    #[error("{0}")]
    Seat(String),
    /// Seat `seat` cancelled this meeting ([`Meeting::cancel`]): nothing ran.
    #[error("seat {seat} cancelled the meeting: {reason}")]
    Cancelled {
        /// The seat that cancelled.
        seat: usize,
        /// Why.
        reason: String,
    },
}

/// A cancelled meeting: who cancelled, why, and which seats have passed it.
struct Cancel {
    seat: usize,
    reason: String,
    passed: Vec<bool>,
}

/// One seat's loan: its references as raw pointers (valid while its thread waits in `meet`),
/// and its key.
struct Loan<A, B, K> {
    a: *const A,
    b: *const B,
    key: K,
}

struct State<A, B, K, R> {
    /// Counts finished runs; the run of a meeting is numbered by the value before it.
    generation: u64,
    seats: Vec<Option<Loan<A, B, K>>>,
    arrived: usize,
    /// A run is using the loans (no seat of this generation may leave).
    running: bool,
    /// The last run's result, for the seats that waited for it.
    outcome: Option<(u64, R)>,
    broken: Option<String>,
    /// The current meeting was cancelled (see [`Meeting::cancel`]).
    cancel: Option<Cancel>,
}

/// `n` seats that meet to run one function over every seat's borrowed `&A` and `&B`. See the
/// [module docs](self).
pub struct Meeting<A, B, K, R> {
    n: usize,
    state: Mutex<State<A, B, K, R>>,
    changed: Condvar,
}

// SAFETY: the raw pointers in `State` are shared `&A`/`&B` loans that other threads read only
// while their lenders are blocked in `meet` (module docs); sharing them needs `A: Sync` and
// `B: Sync`, and keys and results cross threads by value (`Send`).
unsafe impl<A: Sync, B: Sync, K: Send, R: Send> Send for Meeting<A, B, K, R> {}
// SAFETY: as above; every access to the state goes through the mutex.
unsafe impl<A: Sync, B: Sync, K: Send, R: Send> Sync for Meeting<A, B, K, R> {}

/// Marks the run finished even if it panics: the waiting seats must be released either way
/// (after a panic the meeting is broken, and their loans were not used past the unwinding).
struct RunGuard<'m, A, B, K, R: Clone> {
    meeting: &'m Meeting<A, B, K, R>,
    armed: bool,
}

impl<A, B, K, R: Clone> Drop for RunGuard<'_, A, B, K, R> {
    fn drop(&mut self) {
        if self.armed {
            let mut s = self.meeting.lock();
            s.broken
                .get_or_insert_with(|| "a run of the meeting panicked".to_owned());
            s.running = false;
            s.arrived = 0;
            s.seats.iter_mut().for_each(|l| *l = None);
            s.generation += 1;
            self.meeting.changed.notify_all();
        }
    }
}

impl<A, B, K, R: Clone> Meeting<A, B, K, R> {
    /// A meeting of `n` seats.
    pub fn new(n: usize) -> Self {
        Meeting {
            n,
            state: Mutex::new(State {
                generation: 0,
                seats: (0..n).map(|_| None).collect(),
                arrived: 0,
                running: false,
                outcome: None,
                broken: None,
                cancel: None,
            }),
            changed: Condvar::new(),
        }
    }

    /// Seats in the meeting.
    pub fn seats(&self) -> usize {
        self.n
    }

    fn lock(&self) -> MutexGuard<'_, State<A, B, K, R>> {
        // A poisoned lock only means a thread panicked while holding it; the state is kept
        // consistent at every unlock, so go on.
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Breaks the meeting with `reason`: seats waiting now leave with it (unless a run is
    /// using their loans: they leave when it ends), and every later call fails with it.
    pub fn break_with(&self, reason: &str) {
        let mut s = self.lock();
        s.broken.get_or_insert_with(|| reason.to_owned());
        self.changed.notify_all();
    }

    /// Why the meeting is broken, if it is.
    pub fn broken(&self) -> Option<String> {
        self.lock().broken.clone()
    }

    /// Seat `seat` cannot take part in the current meeting (it has not arrived, and will not):
    /// every seat's call of this meeting fails with [`MeetError::Cancelled`] (the waiting ones
    /// at once), nothing runs, and once every seat has passed it the next meeting begins. A
    /// seat that already passed a cancelled meeting, or a broken meeting, changes nothing.
    pub fn cancel(&self, seat: usize, reason: &str) {
        if seat >= self.n {
            return;
        }
        let mut s = self.lock();
        if s.broken.is_some() || s.running || s.seats[seat].is_some() {
            return;
        }
        match &mut s.cancel {
            Some(c) => c.passed[seat] = true,
            None => {
                let mut passed = vec![false; self.n];
                passed[seat] = true;
                s.cancel = Some(Cancel {
                    seat,
                    reason: reason.to_owned(),
                    passed,
                });
            }
        }
        Self::advance_if_all_passed(&mut s);
        self.changed.notify_all();
    }

    /// Takes back a cancellation that no seat but its own has passed (nobody's call failed
    /// from it: the meeting goes on as if it never happened). A cancellation that some seats
    /// passed and others did not is returned as an error: the seats' calls no longer pair up,
    /// so the meeting is broken.
    pub fn settle(&self) -> Result<(), String> {
        let mut s = self.lock();
        let Some(c) = &s.cancel else {
            return Ok(());
        };
        if c.passed.iter().filter(|p| **p).count() == 1 {
            s.cancel = None;
            return Ok(());
        }
        let reason = format!(
            "the seats issued different numbers of calls (seat {} cancelled one: {})",
            c.seat, c.reason
        );
        s.broken.get_or_insert_with(|| reason.clone());
        self.changed.notify_all();
        Err(reason)
    }

    /// Ends a cancelled meeting once every seat has passed it.
    fn advance_if_all_passed(s: &mut State<A, B, K, R>) {
        if s.cancel
            .as_ref()
            .is_some_and(|c| c.passed.iter().all(|p| *p))
        {
            s.cancel = None;
            s.generation += 1;
        }
    }

    /// This seat passes the cancelled meeting (its call fails with the cancellation).
    fn pass(s: &mut State<A, B, K, R>, seat: usize) -> MeetError {
        let c = s.cancel.as_mut().expect("a cancelled meeting");
        c.passed[seat] = true;
        let e = MeetError::Cancelled {
            seat: c.seat,
            reason: c.reason.clone(),
        };
        Self::advance_if_all_passed(s);
        e
    }

    /// Takes seat `seat` with the loans `a` and `b` and the seat's `key`, and waits (to
    /// `deadline`) until every seat has arrived; the last to arrive calls its `run` with every
    /// seat's loans and keys, in seat order, and every seat returns what it returned. A seat
    /// that waits past `deadline` takes its loans back, breaks the meeting and returns
    /// [`MeetError::Timeout`] (unless a run has begun: then it waits for that run, which only
    /// queues work).
    pub fn meet(
        &self,
        seat: usize,
        a: &A,
        b: &B,
        key: K,
        deadline: Deadline,
        run: impl FnOnce(&[&A], &[&B], Vec<K>) -> R,
    ) -> Result<R, MeetError> {
        let mut s = self.lock();
        if let Some(reason) = &s.broken {
            return Err(MeetError::Broken(reason.clone()));
        }
        if seat >= self.n {
            return Err(MeetError::Seat(format!(
                "seat {seat} of a meeting of {}",
                self.n
            )));
        }
        if s.seats[seat].is_some() || s.running {
            return Err(MeetError::Seat(format!(
                "seat {seat} is already in the meeting (one call at a time per seat)"
            )));
        }
        // A cancelled meeting: fail this call with it, or (passed already) wait for the others
        // to pass it before joining the next.
        while let Some(c) = &s.cancel {
            if !c.passed[seat] {
                let e = Self::pass(&mut s, seat);
                self.changed.notify_all();
                return Err(e);
            }
            if let Some(reason) = &s.broken {
                return Err(MeetError::Broken(reason.clone()));
            }
            if deadline.expired() {
                s.broken.get_or_insert_with(|| {
                    format!("seat {seat} timed out waiting for the others to pass a cancelled call")
                });
                self.changed.notify_all();
                return Err(MeetError::Timeout);
            }
            s = self
                .changed
                .wait_timeout(s, deadline.remaining())
                .unwrap_or_else(|p| p.into_inner())
                .0;
        }
        s.seats[seat] = Some(Loan {
            a: a as *const A,
            b: b as *const B,
            key,
        });
        s.arrived += 1;
        let generation = s.generation;
        if s.arrived == self.n {
            let loans: Vec<Loan<A, B, K>> = s
                .seats
                .iter_mut()
                .map(|l| l.take().expect("every seat arrived"))
                .collect();
            s.running = true;
            drop(s);
            let mut guard = RunGuard {
                meeting: self,
                armed: true,
            };
            let mut aa = Vec::with_capacity(self.n);
            let mut bb = Vec::with_capacity(self.n);
            let mut keys = Vec::with_capacity(self.n);
            for l in loans {
                // SAFETY: each loan's thread is blocked in `meet` (it leaves only when
                // `generation` moves past this run, which happens after `run` returns, or by
                // taking its loan back, which `running` forbids), so its `&A`/`&B` are alive
                // for the whole run; `A: Sync`/`B: Sync` let this thread share them. Our own
                // loan is `a`/`b` themselves.
                aa.push(unsafe { &*l.a });
                // SAFETY: as above.
                bb.push(unsafe { &*l.b });
                keys.push(l.key);
            }
            let result = run(&aa, &bb, keys);
            drop((aa, bb));
            let mut s = self.lock();
            s.outcome = Some((generation, result.clone()));
            s.running = false;
            s.arrived = 0;
            s.generation += 1;
            guard.armed = false;
            self.changed.notify_all();
            return Ok(result);
        }
        loop {
            if s.generation > generation {
                return match &s.outcome {
                    Some((g, r)) if *g == generation => Ok(r.clone()),
                    _ => Err(MeetError::Broken(
                        s.broken
                            .clone()
                            .unwrap_or_else(|| "the run did not finish".into()),
                    )),
                };
            }
            if !s.running {
                if s.cancel.is_some() {
                    s.seats[seat] = None;
                    s.arrived -= 1;
                    let e = Self::pass(&mut s, seat);
                    self.changed.notify_all();
                    return Err(e);
                }
                if let Some(reason) = &s.broken {
                    let reason = reason.clone();
                    s.seats[seat] = None;
                    s.arrived -= 1;
                    return Err(MeetError::Broken(reason));
                }
                if deadline.expired() {
                    s.seats[seat] = None;
                    s.arrived -= 1;
                    s.broken.get_or_insert_with(|| {
                        format!("seat {seat} timed out waiting for the other seats")
                    });
                    self.changed.notify_all();
                    return Err(MeetError::Timeout);
                }
            }
            // A run in progress only queues work: wait for it without a deadline of our own,
            // in short steps so a missed wake-up cannot stall us.
            let wait = if s.running {
                std::time::Duration::from_millis(10)
            } else {
                deadline.remaining()
            };
            s = self
                .changed
                .wait_timeout(s, wait)
                .unwrap_or_else(|p| p.into_inner())
                .0;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::Arc;
    use std::time::Duration;

    fn soon() -> Deadline {
        Deadline::after(Duration::from_secs(10))
    }

    #[test]
    fn the_last_seat_runs_over_every_loan_and_all_return_its_result() {
        let m = Arc::new(Meeting::<Vec<u32>, String, u32, Vec<u32>>::new(4));
        for round in 0..50u32 {
            let handles: Vec<_> = (0..4u32)
                .map(|seat| {
                    let m = m.clone();
                    std::thread::spawn(move || {
                        let data = vec![seat * 10 + round];
                        let name = format!("seat {seat}");
                        m.meet(seat as usize, &data, &name, seat, soon(), |aa, bb, keys| {
                            assert_eq!(keys, vec![0, 1, 2, 3]);
                            assert!(
                                bb.iter()
                                    .enumerate()
                                    .all(|(i, b)| **b == format!("seat {i}"))
                            );
                            aa.iter().map(|a| a[0]).collect()
                        })
                    })
                })
                .collect();
            for h in handles {
                let got = h.join().unwrap().unwrap();
                assert_eq!(got, vec![round, 10 + round, 20 + round, 30 + round]);
            }
        }
    }

    #[test]
    fn a_missing_seat_times_out_and_breaks_the_meeting() {
        let m = Arc::new(Meeting::<u8, u8, (), ()>::new(3));
        let m2 = m.clone();
        let other = std::thread::spawn(move || {
            m2.meet(
                1,
                &1,
                &1,
                (),
                Deadline::after(Duration::from_secs(10)),
                |_, _, _| (),
            )
        });
        let t0 = std::time::Instant::now();
        let mine = m.meet(
            0,
            &0,
            &0,
            (),
            Deadline::after(Duration::from_millis(200)),
            |_, _, _| (),
        );
        assert_eq!(mine, Err(MeetError::Timeout));
        // The other seat leaves at once with the reason, not at its own deadline.
        assert!(matches!(other.join().unwrap(), Err(MeetError::Broken(_))));
        assert!(t0.elapsed() < Duration::from_secs(5));
        assert!(matches!(
            m.meet(2, &2, &2, (), soon(), |_, _, _| ()),
            Err(MeetError::Broken(_))
        ));
    }

    #[test]
    fn breaking_releases_the_waiting_seats() {
        let m = Arc::new(Meeting::<u8, u8, (), ()>::new(2));
        let m2 = m.clone();
        let waiter = std::thread::spawn(move || m2.meet(0, &0, &0, (), soon(), |_, _, _| ()));
        std::thread::sleep(Duration::from_millis(50));
        m.break_with("aborted: test");
        assert_eq!(
            waiter.join().unwrap(),
            Err(MeetError::Broken("aborted: test".into()))
        );
    }

    #[test]
    fn a_panicking_run_breaks_the_meeting_and_releases_the_others() {
        let m = Arc::new(Meeting::<u8, u8, (), ()>::new(2));
        let m2 = m.clone();
        let waiter = std::thread::spawn(move || m2.meet(0, &0, &0, (), soon(), |_, _, _| ()));
        std::thread::sleep(Duration::from_millis(50));
        let m3 = m.clone();
        let runner =
            std::thread::spawn(move || m3.meet(1, &1, &1, (), soon(), |_, _, _| panic!("boom")));
        assert!(runner.join().is_err());
        assert!(matches!(waiter.join().unwrap(), Err(MeetError::Broken(_))));
    }

    #[test]
    fn a_cancelled_meeting_fails_every_seat_and_the_next_one_is_whole() {
        let m = Arc::new(Meeting::<u8, u8, u32, u32>::new(3));
        let m2 = m.clone();
        // Seat 1 waits; seat 0 cancels; seat 2 comes later.
        let waiter = std::thread::spawn(move || m2.meet(1, &1, &1, 1, soon(), |_, _, _| 7));
        std::thread::sleep(Duration::from_millis(50));
        m.cancel(0, "refused: too small");
        let cancelled = MeetError::Cancelled {
            seat: 0,
            reason: "refused: too small".into(),
        };
        assert_eq!(waiter.join().unwrap(), Err(cancelled.clone()));
        assert_eq!(m.meet(2, &2, &2, 2, soon(), |_, _, _| 7), Err(cancelled));
        // The next meeting runs, with seat 0 back in it.
        let hs: Vec<_> = (0..3usize)
            .map(|seat| {
                let m = m.clone();
                std::thread::spawn(move || {
                    m.meet(seat, &0, &0, seat as u32, soon(), |_, _, k| k.iter().sum())
                })
            })
            .collect();
        for h in hs {
            assert_eq!(h.join().unwrap(), Ok(3));
        }
        assert_eq!(m.broken(), None);
    }

    #[test]
    fn a_seat_that_passed_a_cancellation_waits_for_the_others_to_pass_it() {
        let m = Arc::new(Meeting::<u8, u8, (), u8>::new(2));
        m.cancel(0, "no");
        let m2 = m.clone();
        // Seat 0 calls again at once: it must not pair with seat 1's cancelled call.
        let again = std::thread::spawn(move || m2.meet(0, &0, &0, (), soon(), |_, _, _| 5));
        std::thread::sleep(Duration::from_millis(50));
        assert!(matches!(
            m.meet(1, &1, &1, (), soon(), |_, _, _| 5),
            Err(MeetError::Cancelled { seat: 0, .. })
        ));
        assert_eq!(m.meet(1, &1, &1, (), soon(), |_, _, _| 5), Ok(5));
        assert_eq!(again.join().unwrap(), Ok(5));
    }

    #[test]
    fn settling_takes_back_an_unseen_cancellation_and_breaks_a_half_seen_one() {
        let m = Meeting::<u8, u8, (), u8>::new(3);
        m.cancel(1, "nobody saw this");
        assert_eq!(m.settle(), Ok(()));
        // The meeting is as it was: seat 1's next call joins the current meeting.
        let m = Arc::new(m);
        let hs: Vec<_> = (0..3usize)
            .map(|seat| {
                let m = m.clone();
                std::thread::spawn(move || m.meet(seat, &0, &0, (), soon(), |_, _, _| 1))
            })
            .collect();
        for h in hs {
            assert_eq!(h.join().unwrap(), Ok(1));
        }
        m.cancel(0, "half seen");
        assert!(m.meet(2, &0, &0, (), soon(), |_, _, _| 1).is_err());
        assert!(m.settle().is_err());
        assert!(m.broken().is_some());
    }

    #[test]
    fn bad_seats_are_refused() {
        let m = Meeting::<u8, u8, (), ()>::new(1);
        assert!(matches!(
            m.meet(1, &0, &0, (), soon(), |_, _, _| ()),
            Err(MeetError::Seat(_))
        ));
        // One seat: the caller is the last to arrive and runs at once.
        assert_eq!(m.meet(0, &0, &0, (), soon(), |_, _, _| ()), Ok(()));
    }
}
