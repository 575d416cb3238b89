//! The paged KV block pool with prefix caching.
//!
//! Blocks are fixed-size pages. A full, computed block is *cached* under its router sequence hash
//! and can be shared by any request whose prompt starts with the same tokens; reference counts say
//! how many running requests use it. Unreferenced blocks wait in an LRU free queue: cached ones can
//! still be hit until they are reused for a new allocation (evicted). A request's blocks are freed
//! tail first, so leaves are evicted before their parents, as in vLLM.
//!
//! Every change of cached state becomes a KV event (`Stored` when a block is cached, `Removed`
//! when a cached block is evicted). With a CPU tier, evicted blocks are kept in host memory and
//! announced with medium CPU; their own eviction from the tier is a CPU `Removed`.

use kvrouter_core::event::{BlockContent, KvEvent, Medium, StoredBlock};
use kvrouter_core::fast_map::FastMap;
use kvrouter_core::hashing::HashNamespace;
use kvrouter_core::ids::{ContentHash, EngineHash, SequenceHash, WorkerRank};
use std::collections::{BTreeMap, VecDeque};

/// Index of a physical block.
pub(crate) type BlockId = u32;

/// What a cached block is: its chain position and what to announce about it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct CachedBlock {
    pub(crate) seq: SequenceHash,
    pub(crate) parent: Option<SequenceHash>,
    pub(crate) content: ContentHash,
    /// Token ids, when known (server mode); events then carry them as engines do.
    pub(crate) tokens: Option<Box<[u32]>>,
    /// The adapter/salt namespace it was hashed in (`None`: the plain one), announced with it
    /// so a router re-hashing its tokens gets the same hashes.
    pub(crate) namespace: Option<std::sync::Arc<HashNamespace>>,
}

#[derive(Clone, Debug, Default)]
struct Block {
    ref_count: u32,
    cached: Option<CachedBlock>,
    prev: Option<BlockId>,
    next: Option<BlockId>,
    in_free: bool,
}

/// Host-memory tier: an LRU set of blocks evicted from the GPU.
#[derive(Debug)]
struct CpuTier {
    capacity: usize,
    blocks: FastMap<SequenceHash, (CachedBlock, u64)>,
    lru: BTreeMap<u64, SequenceHash>,
    tick: u64,
}

/// The pool. Engine hashes on events are the router sequence hashes (they are opaque to routers).
#[derive(Debug)]
pub(crate) struct BlockPool {
    rank: WorkerRank,
    block_size: usize,
    blocks: Vec<Block>,
    head: Option<BlockId>,
    tail: Option<BlockId>,
    free_len: usize,
    cached: FastMap<SequenceHash, BlockId>,
    cpu: Option<CpuTier>,
    events: Vec<KvEvent>,
}

fn eh(seq: SequenceHash) -> EngineHash {
    EngineHash(seq.0)
}

impl BlockPool {
    pub(crate) fn new(
        rank: WorkerRank,
        block_size: usize,
        capacity: usize,
        cpu_blocks: usize,
    ) -> Self {
        let mut pool = Self {
            rank,
            block_size,
            blocks: vec![Block::default(); capacity],
            head: None,
            tail: None,
            free_len: 0,
            cached: FastMap::default(),
            cpu: (cpu_blocks > 0).then(|| CpuTier {
                capacity: cpu_blocks,
                blocks: FastMap::default(),
                lru: BTreeMap::new(),
                tick: 0,
            }),
            events: Vec::new(),
        };
        for id in 0..capacity as BlockId {
            pool.push_back(id);
        }
        pool
    }

    pub(crate) fn capacity(&self) -> usize {
        self.blocks.len()
    }

    /// Blocks that are not free (held by at least one request).
    pub(crate) fn used(&self) -> usize {
        self.blocks.len() - self.free_len
    }

    pub(crate) fn free(&self) -> usize {
        self.free_len
    }

    pub(crate) fn cached_len(&self) -> usize {
        self.cached.len()
    }

    pub(crate) fn take_events(&mut self) -> Vec<KvEvent> {
        std::mem::take(&mut self.events)
    }

    fn unlink(&mut self, id: BlockId) {
        let (prev, next) = {
            let b = &self.blocks[id as usize];
            (b.prev, b.next)
        };
        match prev {
            Some(p) => self.blocks[p as usize].next = next,
            None => self.head = next,
        }
        match next {
            Some(n) => self.blocks[n as usize].prev = prev,
            None => self.tail = prev,
        }
        let b = &mut self.blocks[id as usize];
        b.prev = None;
        b.next = None;
        b.in_free = false;
        self.free_len -= 1;
    }

    fn push_back(&mut self, id: BlockId) {
        let old_tail = self.tail;
        {
            let b = &mut self.blocks[id as usize];
            b.prev = old_tail;
            b.next = None;
            b.in_free = true;
        }
        match old_tail {
            Some(t) => self.blocks[t as usize].next = Some(id),
            None => self.head = Some(id),
        }
        self.tail = Some(id);
        self.free_len += 1;
    }

    fn push_front(&mut self, id: BlockId) {
        let old_head = self.head;
        {
            let b = &mut self.blocks[id as usize];
            b.next = old_head;
            b.prev = None;
            b.in_free = true;
        }
        match old_head {
            Some(h) => self.blocks[h as usize].prev = Some(id),
            None => self.tail = Some(id),
        }
        self.head = Some(id);
        self.free_len += 1;
    }

    /// A fresh block (reference count 1), evicting the least recently used free block.
    pub(crate) fn allocate(&mut self) -> Option<BlockId> {
        let id = self.head?;
        self.unlink(id);
        if let Some(cached) = self.blocks[id as usize].cached.take() {
            self.cached.remove(&cached.seq);
            self.events.push(KvEvent::Removed {
                worker: self.rank.worker,
                dp_rank: self.rank.dp_rank,
                engine_hashes: vec![eh(cached.seq)],
                medium: Medium::Gpu,
            });
            self.offload(cached);
        }
        self.blocks[id as usize].ref_count = 1;
        Some(id)
    }

    /// Takes another reference to a block (a prefix-cache hit).
    pub(crate) fn share(&mut self, id: BlockId) {
        if self.blocks[id as usize].in_free {
            self.unlink(id);
        }
        self.blocks[id as usize].ref_count += 1;
    }

    /// Drops one request's references, tail first, so its leaves are evicted before its parents.
    pub(crate) fn release(&mut self, ids: &[BlockId]) {
        for &id in ids.iter().rev() {
            let b = &mut self.blocks[id as usize];
            debug_assert!(b.ref_count > 0, "double free of block {id}");
            b.ref_count -= 1;
            if b.ref_count == 0 {
                if b.cached.is_some() {
                    self.push_back(id);
                } else {
                    self.push_front(id);
                }
            }
        }
    }

    /// Whether a block sits in the free queue (unreferenced).
    pub(crate) fn is_free(&self, id: BlockId) -> bool {
        self.blocks[id as usize].in_free
    }

    /// The cached block for a sequence hash.
    pub(crate) fn lookup(&self, seq: SequenceHash) -> Option<BlockId> {
        self.cached.get(&seq).copied()
    }

    /// Whether the CPU tier holds a block.
    pub(crate) fn cpu_lookup(&self, seq: SequenceHash) -> Option<&CachedBlock> {
        self.cpu
            .as_ref()
            .and_then(|c| c.blocks.get(&seq))
            .map(|(b, _)| b)
    }

    /// Registers a full, computed block under its sequence hash. Returns false (and caches
    /// nothing) when another block already holds that hash.
    pub(crate) fn cache(&mut self, id: BlockId, block: CachedBlock) -> bool {
        if self.cached.contains_key(&block.seq) {
            return false;
        }
        self.cached.insert(block.seq, id);
        self.announce(&block, Medium::Gpu);
        self.blocks[id as usize].cached = Some(block);
        true
    }

    fn announce(&mut self, block: &CachedBlock, medium: Medium) {
        let content = match &block.tokens {
            Some(tokens) => BlockContent::Tokens(tokens.to_vec()),
            None => BlockContent::Hash(block.content),
        };
        let stored = StoredBlock {
            engine_hash: eh(block.seq),
            content,
        };
        // Extend the previous event when this block continues its chain.
        let namespace = block
            .namespace
            .as_deref()
            .cloned()
            .unwrap_or_else(HashNamespace::none);
        if let Some(KvEvent::Stored {
            blocks,
            medium: m,
            namespace: ns,
            ..
        }) = self.events.last_mut()
        {
            let continues = blocks.last().map(|b| b.engine_hash) == block.parent.map(eh);
            let same_kind = matches!(
                (&blocks[0].content, &stored.content),
                (BlockContent::Tokens(_), BlockContent::Tokens(_))
                    | (BlockContent::Hash(_), BlockContent::Hash(_))
            );
            if *m == medium && continues && same_kind && *ns == namespace {
                blocks.push(stored);
                return;
            }
        }
        self.events.push(KvEvent::Stored {
            worker: self.rank.worker,
            dp_rank: self.rank.dp_rank,
            parent: block.parent.map(eh),
            blocks: vec![stored],
            block_size: self.block_size,
            medium,
            namespace,
        });
    }

    fn offload(&mut self, block: CachedBlock) {
        let Some(cpu) = &mut self.cpu else { return };
        cpu.tick += 1;
        let tick = cpu.tick;
        if let Some((_, old_tick)) = cpu.blocks.get_mut(&block.seq) {
            cpu.lru.remove(old_tick);
            *old_tick = tick;
            cpu.lru.insert(tick, block.seq);
            return;
        }
        let mut evicted = Vec::new();
        while cpu.blocks.len() >= cpu.capacity {
            let Some((_, seq)) = cpu.lru.pop_first() else {
                break;
            };
            cpu.blocks.remove(&seq);
            evicted.push(eh(seq));
        }
        cpu.lru.insert(tick, block.seq);
        cpu.blocks.insert(block.seq, (block.clone(), tick));
        if !evicted.is_empty() {
            self.events.push(KvEvent::Removed {
                worker: self.rank.worker,
                dp_rank: self.rank.dp_rank,
                engine_hashes: evicted,
                medium: Medium::Cpu,
            });
        }
        self.announce(&block, Medium::Cpu);
    }

    /// Drops every cached block (GPU and CPU) and announces `Cleared`. Blocks in use stay
    /// allocated but are no longer cached.
    pub(crate) fn clear(&mut self) {
        for b in &mut self.blocks {
            b.cached = None;
        }
        self.cached.clear();
        if let Some(cpu) = &mut self.cpu {
            cpu.blocks.clear();
            cpu.lru.clear();
        }
        self.events.push(KvEvent::Cleared {
            worker: self.rank.worker,
            dp_rank: self.rank.dp_rank,
        });
    }

    /// Checks reference counts and the free queue against the requests' block tables.
    pub(crate) fn check(&self, tables: &[&[BlockId]]) -> Result<(), String> {
        let mut refs = vec![0u32; self.blocks.len()];
        for table in tables {
            for &id in *table {
                refs[id as usize] += 1;
            }
        }
        let mut free = 0;
        let mut cur = self.head;
        let mut seen = VecDeque::new();
        while let Some(id) = cur {
            free += 1;
            seen.push_back(id);
            if free > self.blocks.len() {
                return Err("free queue has a cycle".into());
            }
            cur = self.blocks[id as usize].next;
        }
        if free != self.free_len {
            return Err(format!(
                "free queue has {free} blocks, counter says {}",
                self.free_len
            ));
        }
        for (id, b) in self.blocks.iter().enumerate() {
            if b.ref_count != refs[id] {
                return Err(format!(
                    "block {id}: ref count {} but {} users",
                    b.ref_count, refs[id]
                ));
            }
            if b.in_free != (b.ref_count == 0) {
                return Err(format!(
                    "block {id}: in free queue {} with {} refs",
                    b.in_free, b.ref_count
                ));
            }
            if let Some(c) = &b.cached {
                if self.cached.get(&c.seq) != Some(&(id as BlockId)) {
                    return Err(format!("block {id} cached but not in the map"));
                }
            }
        }
        if self.cached.len() != self.blocks.iter().filter(|b| b.cached.is_some()).count() {
            return Err("cache map and blocks disagree".into());
        }
        Ok(())
    }
}
