//! Uploads that do not stop the host: what PyTorch's `pin_memory=True, non_blocking=True` does.
//!
//! A [`Staging`] keeps a few pinned (page-locked) host buffers. An upload takes a free one that fits
//! best, lets the caller write the values straight into it, and queues the copy to the
//! device in stream order (`cuMemcpyHtoDAsync`); an event recorded after the copy says when the
//! buffer may be written again. So assembling a batch on the host overlaps the kernels still
//! queued for the micro-batch before it, and nothing waits for the GPU to drain.
//!
//! The copy goes on the compute stream, not a second one: memfit's allocator hands a batch the
//! block that the kernels queued before it may still be using (it is deterministic, one pool for
//! every tensor), so the copy must follow them in any case, and the stream orders that for free.
//! The host waits only when every buffer still has a copy in flight and [`MAX_BUFFERS`] exist.
//!
//! Pinned bytes are host memory: [`Staging::pinned_bytes`] reports them (the report's host section).

use crate::machine::Machine;
use crate::CudaError;
use std::collections::VecDeque;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

/// The most pinned buffers kept: enough for a step's uploads (inputs, targets, positions) to
/// rotate through without waiting.
pub const MAX_BUFFERS: usize = 8;
/// The smallest buffer made (a buffer grows, by powers of two, to the largest upload it carried).
pub const MIN_BUFFER_BYTES: usize = 64 << 10;

/// One pinned buffer and the event recorded after the last copy from it.
struct Buffer {
    host: u64,
    bytes: usize,
    event: u64,
}

/// Pinned buffers of one device (see the module's docs).
pub struct Staging {
    machine: Arc<dyn Machine>,
    /// Buffers not being filled, the one whose copy was queued first at the front.
    buffers: Mutex<VecDeque<Buffer>>,
    pinned: AtomicU64,
    peak: AtomicU64,
}

impl Staging {
    pub fn new(machine: Arc<dyn Machine>) -> Self {
        Staging { machine, buffers: Mutex::new(VecDeque::new()), pinned: AtomicU64::new(0), peak: AtomicU64::new(0) }
    }

    /// Pinned host bytes held now, and the most held at once.
    pub fn pinned_bytes(&self) -> (u64, u64) {
        (self.pinned.load(Ordering::Relaxed), self.peak.load(Ordering::Relaxed))
    }

    /// Copies `bytes` to device memory at `dst`, in stream order, after `fill` wrote them into a
    /// pinned buffer (aligned to 4 KiB, of `bytes` bytes, its old contents left as they were).
    /// Returns once the copy is queued.
    pub fn upload(&self, dst: u64, bytes: usize, fill: impl FnOnce(&mut [u8])) -> Result<(), CudaError> {
        if bytes == 0 {
            fill(&mut []);
            return Ok(());
        }
        let buffer = self.take(bytes)?;
        // SAFETY: the buffer is pinned memory of `buffer.bytes >= bytes` bytes that only this call
        // holds (taken out of the queue), and no copy from it is pending (`take` waited for it).
        fill(unsafe { std::slice::from_raw_parts_mut(buffer.host as *mut u8, bytes) });
        let queued = self.machine.upload_async(dst, buffer.host, bytes);
        // Recorded even when the copy failed: the event then marks the work already queued.
        if let Err(e) = self.machine.event_record(buffer.event) {
            // Nothing says when a copy from it is done any more: the buffer is left as it is
            // (a few KiB for the process's life) rather than freed under a copy.
            self.pinned.fetch_sub(buffer.bytes as u64, Ordering::Relaxed);
            return Err(e);
        }
        self.buffers.lock().unwrap_or_else(|e| e.into_inner()).push_back(buffer);
        queued
    }

    /// A buffer of at least `bytes` with no copy from it pending: of those whose copy is done, the
    /// smallest large enough (else the largest, grown); with none done, a new one, or once
    /// [`MAX_BUFFERS`] exist the one whose copy was queued first, waited for.
    fn take(&self, bytes: usize) -> Result<Buffer, CudaError> {
        let oldest = {
            let mut buffers = self.buffers.lock().unwrap_or_else(|e| e.into_inner());
            let mut done = Vec::new();
            for (i, b) in buffers.iter().enumerate() {
                if self.machine.event_done(b.event)? {
                    done.push(i);
                }
            }
            let fitting = done.iter().copied().filter(|&i| buffers[i].bytes >= bytes).min_by_key(|&i| buffers[i].bytes);
            match fitting.or_else(|| done.iter().copied().max_by_key(|&i| buffers[i].bytes)) {
                Some(i) => buffers.remove(i),
                None if buffers.len() >= MAX_BUFFERS => buffers.pop_front(),
                None => None,
            }
        };
        let mut buffer = match oldest {
            Some(b) => b,
            None => Buffer { host: 0, bytes: 0, event: self.machine.event_create()? },
        };
        if let Err(e) = self.machine.event_wait(buffer.event) {
            // As in `upload`: with no word on its copy, the buffer is left, never freed under it.
            self.pinned.fetch_sub(buffer.bytes as u64, Ordering::Relaxed);
            return Err(e);
        }
        if buffer.bytes < bytes {
            self.release_memory(&mut buffer);
            let size = bytes.max(MIN_BUFFER_BYTES).next_power_of_two();
            match self.machine.pinned_alloc(size) {
                Ok(host) => {
                    buffer.host = host;
                    buffer.bytes = size;
                    let now = self.pinned.fetch_add(size as u64, Ordering::Relaxed) + size as u64;
                    self.peak.fetch_max(now, Ordering::Relaxed);
                }
                Err(e) => {
                    self.drop_buffer(&mut buffer);
                    return Err(e);
                }
            }
        }
        Ok(buffer)
    }

    /// Frees a buffer's pinned memory (no copy from it is pending).
    fn release_memory(&self, buffer: &mut Buffer) {
        if buffer.bytes > 0 {
            self.machine.pinned_free(buffer.host);
            self.pinned.fetch_sub(buffer.bytes as u64, Ordering::Relaxed);
            buffer.bytes = 0;
        }
    }

    fn drop_buffer(&self, buffer: &mut Buffer) {
        self.release_memory(buffer);
        self.machine.event_destroy(buffer.event);
    }
}

impl Drop for Staging {
    fn drop(&mut self) {
        let buffers: Vec<Buffer> = self.buffers.lock().unwrap_or_else(|e| e.into_inner()).drain(..).collect();
        for mut b in buffers {
            let _ = self.machine.event_wait(b.event);
            self.drop_buffer(&mut b);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::machine::{Arg, Gemm, Launch};
    use std::collections::HashMap;

    /// A machine whose copies stay pending until `finish` is called, to see what the staging waits for.
    #[derive(Default)]
    struct Pending {
        state: Mutex<State>,
    }

    #[derive(Default)]
    struct State {
        next: u64,
        /// Event -> whether the work before its mark is done.
        events: HashMap<u64, bool>,
        /// Pinned allocations live, by address.
        pinned: HashMap<u64, Vec<u8>>,
        copies: Vec<(u64, Vec<u8>)>,
        waits: usize,
    }

    impl Pending {
        fn finish(&self) {
            self.state.lock().unwrap().events.values_mut().for_each(|d| *d = true);
        }
    }

    impl Machine for Pending {
        fn description(&self) -> String {
            "pending".into()
        }
        fn max_blocks(&self) -> u32 {
            1
        }
        fn free_bytes(&self) -> Result<u64, CudaError> {
            Ok(0)
        }
        fn alloc(&self, _: usize) -> Result<u64, CudaError> {
            unreachable!()
        }
        fn free(&self, _: u64) {}
        fn upload(&self, _: u64, _: &[u8]) -> Result<(), CudaError> {
            unreachable!()
        }
        fn pinned_alloc(&self, bytes: usize) -> Result<u64, CudaError> {
            let mut s = self.state.lock().unwrap();
            let buffer = vec![0u8; bytes];
            let host = buffer.as_ptr() as u64;
            s.pinned.insert(host, buffer);
            Ok(host)
        }
        fn pinned_free(&self, host: u64) {
            assert!(self.state.lock().unwrap().pinned.remove(&host).is_some(), "freed twice or never made");
        }
        fn upload_async(&self, dst: u64, host: u64, bytes: usize) -> Result<(), CudaError> {
            let mut s = self.state.lock().unwrap();
            let data = s.pinned[&host][..bytes].to_vec();
            s.copies.push((dst, data));
            Ok(())
        }
        fn event_create(&self) -> Result<u64, CudaError> {
            let mut s = self.state.lock().unwrap();
            s.next += 1;
            let e = s.next;
            s.events.insert(e, true);
            Ok(e)
        }
        fn event_record(&self, event: u64) -> Result<(), CudaError> {
            self.state.lock().unwrap().events.insert(event, false);
            Ok(())
        }
        fn event_done(&self, event: u64) -> Result<bool, CudaError> {
            Ok(self.state.lock().unwrap().events[&event])
        }
        fn event_wait(&self, event: u64) -> Result<(), CudaError> {
            let mut s = self.state.lock().unwrap();
            if !s.events[&event] {
                s.waits += 1;
                s.events.insert(event, true);
            }
            Ok(())
        }
        fn event_destroy(&self, event: u64) {
            self.state.lock().unwrap().events.remove(&event);
        }
        fn download(&self, _: u64, _: &mut [u8]) -> Result<(), CudaError> {
            Ok(())
        }
        fn copy(&self, _: u64, _: u64, _: usize) -> Result<(), CudaError> {
            unreachable!()
        }
        fn zero(&self, _: u64, _: usize) -> Result<(), CudaError> {
            unreachable!()
        }
        fn launch(&self, _: &str, _: Launch, _: &mut [Arg]) -> Result<(), CudaError> {
            unreachable!()
        }
        fn set_library_workspace(&self, _: u64, _: usize) -> Result<(), CudaError> {
            unreachable!()
        }
        fn gemm(&self, _: &Gemm) -> Result<(), CudaError> {
            unreachable!()
        }
    }

    /// While copies are in flight, each upload gets a buffer of its own (nothing waits) until
    /// MAX_BUFFERS exist; then the oldest is waited for and reused; free ones are taken best fit. Each copy carries what its fill
    /// wrote, and every buffer is freed with the staging.
    #[test]
    fn uploads_rotate_through_buffers_and_wait_only_when_all_are_in_flight() {
        let machine = Arc::new(Pending::default());
        let staging = Staging::new(machine.clone());
        for i in 0..MAX_BUFFERS as u8 {
            staging.upload(100 + i as u64, 3, |b| b.copy_from_slice(&[i, i, i])).unwrap();
        }
        {
            let s = machine.state.lock().unwrap();
            assert_eq!(s.waits, 0);
            assert_eq!(s.pinned.len(), MAX_BUFFERS);
            assert_eq!(s.copies[5], (105, vec![5, 5, 5]));
        }
        assert_eq!(staging.pinned_bytes().0, (MAX_BUFFERS * MIN_BUFFER_BYTES) as u64);
        staging.upload(200, 2, |b| b.copy_from_slice(&[7, 8])).unwrap();
        assert_eq!(machine.state.lock().unwrap().waits, 1, "the oldest buffer's copy is waited for");
        assert_eq!(machine.state.lock().unwrap().pinned.len(), MAX_BUFFERS);
        // Once the device caught up, a buffer is reused without waiting, and one too small grows.
        machine.finish();
        staging.upload(300, MIN_BUFFER_BYTES + 1, |b| b[MIN_BUFFER_BYTES] = 9).unwrap();
        {
            let s = machine.state.lock().unwrap();
            assert_eq!(s.waits, 1);
            assert_eq!(s.pinned.len(), MAX_BUFFERS);
            assert_eq!(s.copies.last().unwrap().1[MIN_BUFFER_BYTES], 9);
        }
        let (now, peak) = staging.pinned_bytes();
        assert_eq!(now, ((MAX_BUFFERS - 1) * MIN_BUFFER_BYTES + 2 * MIN_BUFFER_BYTES) as u64);
        assert!(peak >= now);
        // Best fit: a small upload takes a small buffer, so the large one is free for the next
        // large upload, which grows nothing.
        machine.finish();
        staging.upload(400, 10, |b| b.fill(1)).unwrap();
        staging.upload(500, MIN_BUFFER_BYTES + 1, |b| b.fill(2)).unwrap();
        assert_eq!(staging.pinned_bytes().0, now, "no buffer grew");
        drop(staging);
        let s = machine.state.lock().unwrap();
        assert!(s.pinned.is_empty() && s.events.is_empty(), "every buffer and event given back");
    }
}
