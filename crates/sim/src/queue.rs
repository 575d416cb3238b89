//! The event queue: ordered by (time, sequence), so simultaneous events run in the order they
//! were scheduled.

use kvrouter_core::time::Time;
use std::cmp::Ordering;
use std::collections::BinaryHeap;

struct Entry<E> {
    at: Time,
    seq: u64,
    event: E,
}

impl<E> PartialEq for Entry<E> {
    fn eq(&self, other: &Self) -> bool {
        (self.at, self.seq) == (other.at, other.seq)
    }
}
impl<E> Eq for Entry<E> {}
impl<E> PartialOrd for Entry<E> {
    fn partial_cmp(&self, other: &Self) -> Option<Ordering> {
        Some(self.cmp(other))
    }
}
impl<E> Ord for Entry<E> {
    fn cmp(&self, other: &Self) -> Ordering {
        // Reversed: the heap pops the earliest (time, sequence) first.
        (other.at, other.seq).cmp(&(self.at, self.seq))
    }
}

/// A min-queue of timed events.
pub(crate) struct EventQueue<E> {
    heap: BinaryHeap<Entry<E>>,
    next: u64,
}

impl<E> EventQueue<E> {
    pub(crate) fn new() -> Self {
        Self {
            heap: BinaryHeap::new(),
            next: 0,
        }
    }

    pub(crate) fn push(&mut self, at: Time, event: E) {
        self.heap.push(Entry {
            at,
            seq: self.next,
            event,
        });
        self.next += 1;
    }

    pub(crate) fn peek_time(&self) -> Option<Time> {
        self.heap.peek().map(|e| e.at)
    }

    pub(crate) fn pop(&mut self) -> Option<(Time, E)> {
        self.heap.pop().map(|e| (e.at, e.event))
    }

    /// Events waiting.
    pub(crate) fn len(&self) -> usize {
        self.heap.len()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ties_are_first_in_first_out() {
        let mut q = EventQueue::new();
        q.push(Time(5), "b");
        q.push(Time(1), "a");
        q.push(Time(5), "c");
        let order: Vec<&str> = std::iter::from_fn(|| q.pop().map(|(_, e)| e)).collect();
        assert_eq!(order, vec!["a", "b", "c"]);
    }
}
