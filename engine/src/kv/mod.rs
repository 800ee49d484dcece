//! The paged KV cache: physical bytes ([`pool::KvPool`]) and their logical bookkeeping
//! ([`block_manager::BlockManager`]: reference counts, prefix cache, LRU eviction).
//!
//! The two are deliberately separate (Dynamo's kvbm-logical / kvbm-physical split): the block
//! manager never touches bytes, and the pool never decides who owns a block.

pub mod block_manager;
pub mod pool;

pub use block_manager::{BlockId, BlockManager, CacheEvent, hash_block};
pub use pool::{KvBacking, KvPool};
