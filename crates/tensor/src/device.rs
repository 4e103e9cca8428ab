//! A device owns one allocator and the execution context of the programs that run on it: the
//! current [`Phase`] and whether autograd records. `cpu` computes; `meta` allocates exactly what
//! `cpu` would, through the same allocator code, but holds no data and runs no kernel.

use crate::error::{Error, Result};
use crate::storage::Storage;
use memfit_memory::{
    Allocator, AllocatorConfig, Category, FaultInjection, HostBackend, MemoryStats, MetaBackend, Phase, Request,
    SegmentBackend,
};
use std::fmt;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum DeviceKind {
    Cpu,
    Meta,
}

impl DeviceKind {
    pub fn name(self) -> &'static str {
        match self {
            DeviceKind::Cpu => "cpu",
            DeviceKind::Meta => "meta",
        }
    }

    /// Parses `cpu` or `meta`.
    pub fn parse(text: &str) -> Result<Self> {
        match text {
            "cpu" => Ok(DeviceKind::Cpu),
            "meta" => Ok(DeviceKind::Meta),
            other => Err(Error::invalid(format!("unknown device {other:?}: expected cpu or meta"))),
        }
    }
}

impl fmt::Display for DeviceKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

#[derive(Clone, Debug)]
pub struct DeviceConfig {
    pub kind: DeviceKind,
    /// The device's memory; None = unlimited.
    pub capacity: Option<u64>,
    pub fault: Option<FaultInjection>,
    pub timeline_events: usize,
}

impl DeviceConfig {
    pub fn new(kind: DeviceKind) -> Self {
        DeviceConfig { kind, capacity: None, fault: None, timeline_events: AllocatorConfig::default().timeline_events }
    }

    pub fn capacity(mut self, bytes: Option<u64>) -> Self {
        self.capacity = bytes;
        self
    }

    pub fn fault(mut self, fault: Option<FaultInjection>) -> Self {
        self.fault = fault;
        self
    }
}

struct DeviceInner {
    kind: DeviceKind,
    allocator: Mutex<Allocator>,
    phase: Mutex<Phase>,
    grad_enabled: AtomicBool,
    next_id: AtomicU64,
}

/// A handle to a device; clones share it. Tensors of different devices never mix.
#[derive(Clone)]
pub struct Device(Arc<DeviceInner>);

impl Device {
    pub fn new(config: DeviceConfig) -> Self {
        let backend: Box<dyn SegmentBackend> = match config.kind {
            DeviceKind::Cpu => Box::new(HostBackend::default()),
            DeviceKind::Meta => Box::new(MetaBackend),
        };
        let allocator = Allocator::new(
            backend,
            AllocatorConfig { capacity: config.capacity, timeline_events: config.timeline_events, fault: config.fault },
        );
        Device(Arc::new(DeviceInner {
            kind: config.kind,
            allocator: Mutex::new(allocator),
            phase: Mutex::new(Phase::Setup),
            grad_enabled: AtomicBool::new(true),
            next_id: AtomicU64::new(1),
        }))
    }

    /// A `cpu` device with unlimited capacity.
    pub fn cpu() -> Self {
        Device::new(DeviceConfig::new(DeviceKind::Cpu))
    }

    /// A `meta` device with unlimited capacity.
    pub fn meta() -> Self {
        Device::new(DeviceConfig::new(DeviceKind::Meta))
    }

    pub fn kind(&self) -> DeviceKind {
        self.0.kind
    }

    /// True when kernels run (and data exists) on this device.
    pub fn computes(&self) -> bool {
        self.0.kind == DeviceKind::Cpu
    }

    pub fn same(&self, other: &Device) -> bool {
        Arc::ptr_eq(&self.0, &other.0)
    }

    pub(crate) fn next_id(&self) -> u64 {
        self.0.next_id.fetch_add(1, Ordering::Relaxed)
    }

    /// Locks the allocator, for statistics, the timeline and cache control.
    pub fn allocator(&self) -> MutexGuard<'_, Allocator> {
        // A poisoned lock means a panic elsewhere already; the allocator's own state is consistent
        // between calls, so keep using it.
        self.0.allocator.lock().unwrap_or_else(|e| e.into_inner())
    }

    pub fn stats(&self) -> MemoryStats {
        self.allocator().stats().clone()
    }

    pub fn capacity(&self) -> Option<u64> {
        self.allocator().capacity()
    }

    /// Allocates storage for `bytes` bytes, tagged with `category`, on behalf of `op`.
    pub fn allocate(&self, bytes: usize, category: Category, op: &'static str) -> Result<Storage> {
        let request = Request { category, op, phase: self.phase(), module: 0 };
        let allocation = self.allocator().allocate(bytes as u64, request)?;
        Ok(Storage::new(self.clone(), allocation))
    }

    pub fn phase(&self) -> Phase {
        *self.0.phase.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Sets the phase until the guard drops (then restores the previous one).
    pub fn enter_phase(&self, phase: Phase) -> PhaseGuard {
        let mut current = self.0.phase.lock().unwrap_or_else(|e| e.into_inner());
        let previous = std::mem::replace(&mut *current, phase);
        PhaseGuard { device: self.clone(), previous }
    }

    pub fn grad_enabled(&self) -> bool {
        self.0.grad_enabled.load(Ordering::Relaxed)
    }

    /// Disables graph recording until the guard drops: no graph is kept and nothing is saved.
    pub fn no_grad(&self) -> GradModeGuard {
        let previous = self.0.grad_enabled.swap(false, Ordering::Relaxed);
        GradModeGuard { device: self.clone(), previous }
    }

    /// Enables graph recording until the guard drops, also inside a no-grad region (a backward pass
    /// runs under no-grad; activation checkpointing re-runs its forward inside it with this).
    pub fn enable_grad(&self) -> GradModeGuard {
        let previous = self.0.grad_enabled.swap(true, Ordering::Relaxed);
        GradModeGuard { device: self.clone(), previous }
    }
}

impl fmt::Debug for Device {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "Device({})", self.0.kind)
    }
}

/// Restores the previous phase on drop.
pub struct PhaseGuard {
    device: Device,
    previous: Phase,
}

impl Drop for PhaseGuard {
    fn drop(&mut self) {
        *self.device.0.phase.lock().unwrap_or_else(|e| e.into_inner()) = self.previous;
    }
}

/// Restores the previous grad mode on drop.
pub struct GradModeGuard {
    device: Device,
    previous: bool,
}

impl Drop for GradModeGuard {
    fn drop(&mut self) {
        self.device.0.grad_enabled.store(self.previous, Ordering::Relaxed);
    }
}
