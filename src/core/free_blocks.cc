#include "core/free_blocks.h"

#include <algorithm>
#include <exception>
#include <iterator>

#include "dtrain/core/error.h"
#include "dtrain/core/logging.h"

namespace dtrain::detail {

// --- FreeBlocks ---

void FreeBlocks::insert(char* ptr, size_t size, uintptr_t segment) {
  by_size_.emplace(size, ptr);
  by_addr_.emplace(ptr, Range{size, segment});
  bytes_ += size;
}

void FreeBlocks::erase(std::map<char*, Range>::iterator it) {
  by_size_.erase({it->second.size, it->first});
  bytes_ -= it->second.size;
  by_addr_.erase(it);
}

FreeBlocks::Block FreeBlocks::take(size_t n, size_t min_rest) {
  auto fit = by_size_.lower_bound({n, nullptr});
  if (n == 0 || fit == by_size_.end()) return {};
  char* const ptr = fit->second;
  auto it = by_addr_.find(ptr);
  const Range r = it->second;
  erase(it);
  if (r.size - n >= min_rest && r.size > n) {
    insert(ptr + n, r.size - n, r.segment);
    return {ptr, n, r.segment};
  }
  return {ptr, r.size, r.segment};
}

void FreeBlocks::put(char* ptr, size_t size, uintptr_t segment) {
  DTRAIN_CHECK(size > 0, "FreeBlocks::put of an empty range");
  // Checked before anything changes: a range freed twice leaves the books as they were.
  auto next = by_addr_.lower_bound(ptr);
  DTRAIN_CHECK(next == by_addr_.end() || next->first >= ptr + size,
               "FreeBlocks::put of a range that overlaps a free one");
  DTRAIN_CHECK(
      next == by_addr_.begin() || std::prev(next)->first + std::prev(next)->second.size <= ptr,
      "FreeBlocks::put of a range that overlaps a free one");
  if (next != by_addr_.end() && next->first == ptr + size && next->second.segment == segment) {
    size += next->second.size;
    next = std::next(next);
    erase(std::prev(next));
  }
  if (next != by_addr_.begin()) {
    auto prev = std::prev(next);
    if (prev->first + prev->second.size == ptr && prev->second.segment == segment) {
      ptr = prev->first;
      size += prev->second.size;
      erase(prev);
    }
  }
  insert(ptr, size, segment);
}

bool FreeBlocks::remove_exact(char* ptr, size_t size) {
  auto it = by_addr_.find(ptr);
  if (it == by_addr_.end() || it->second.size != size) return false;
  erase(it);
  return true;
}

std::vector<FreeBlocks::Block> FreeBlocks::clear() {
  std::vector<Block> out;
  out.reserve(by_addr_.size());
  for (const auto& [ptr, r] : by_addr_) out.push_back({ptr, r.size, r.segment});
  by_addr_.clear();
  by_size_.clear();
  bytes_ = 0;
  return out;
}

// --- SegmentCache ---

size_t SegmentCache::round(size_t n) {
  if (n == 0) return kAlignment;
  DTRAIN_CHECK(n <= kMaxRequest, "SegmentCache: a request of ", n, " bytes");
  return (n + kAlignment - 1) / kAlignment * kAlignment;
}

size_t SegmentCache::exact_segment_size(size_t n) {
  const size_t r = round(n);
  if (r <= kSmallRequest) return kSmallSegment;
  return (r + kSegmentGranularity - 1) / kSegmentGranularity * kSegmentGranularity;
}

size_t SegmentCache::segment_size(size_t n) const {
  const size_t exact = exact_segment_size(n);
  if (round(n) <= kSmallRequest) return exact;
  if (policy_ == Policy::kPyTorch) return round(n) < (size_t{10} << 20) ? size_t{20} << 20 : exact;
  const size_t twice = 2 * std::max(largest_request_, round(n));
  return std::max({exact, kMinRegion,
                   (twice + kSegmentGranularity - 1) / kSegmentGranularity * kSegmentGranularity});
}

SegmentCache::Block SegmentCache::take(size_t n) {
  const size_t r = round(n);
  const bool small = r <= kSmallRequest;
  if (!small) largest_request_ = std::max(largest_request_, r);
  const FreeBlocks::Block b = small ? small_.take(r, kAlignment) : large_.take(r, kSmallRequest);
  return {b.ptr, b.size};
}

void SegmentCache::add_segment(void* ptr, size_t size, size_t n) {
  char* const base = static_cast<char*>(ptr);
  const bool small = round(n) <= kSmallRequest;
  DTRAIN_CHECK(ptr && size >= round(n), "SegmentCache::add_segment: a segment too small");
  const bool fresh = segments_.emplace(base, Segment{size, small}).second;
  DTRAIN_CHECK(fresh, "SegmentCache::add_segment: a segment added twice");
  reserved_ += size;
  if (reserved_ > peak_reserved_) peak_reserved_ = reserved_;
  (small ? small_ : large_).put(base, size, reinterpret_cast<uintptr_t>(base));
}

const std::pair<char* const, SegmentCache::Segment>& SegmentCache::segment_of(char* p) const {
  auto it = segments_.upper_bound(p);
  DTRAIN_CHECK(it != segments_.begin(), "SegmentCache: a block outside every segment");
  --it;
  DTRAIN_CHECK(p < it->first + it->second.size, "SegmentCache: a block outside every segment");
  return *it;
}

void SegmentCache::put(void* ptr, size_t size) {
  char* const p = static_cast<char*>(ptr);
  const auto& [base, seg] = segment_of(p);
  DTRAIN_CHECK(p + size <= base + seg.size, "SegmentCache::put: a block past its segment's end");
  (seg.small ? small_ : large_).put(p, size, reinterpret_cast<uintptr_t>(base));
}

std::vector<SegmentCache::Block> SegmentCache::take_free_segments() {
  std::vector<Block> out;
  for (auto it = segments_.begin(); it != segments_.end();) {
    FreeBlocks& blocks = it->second.small ? small_ : large_;
    if (blocks.remove_exact(it->first, it->second.size)) {
      out.push_back({it->first, it->second.size, it->second.small});
      reserved_ -= it->second.size;
      it = segments_.erase(it);
    } else {
      ++it;
    }
  }
  return out;
}

void SegmentCache::put_back_segments(const std::vector<Block>& segments) {
  for (const Block& b : segments) add_segment(b.ptr, b.size, b.small ? 1 : b.size);
}

// --- SegmentPool ---

SegmentPool::SegmentPool(Backend& backend, std::string device)
    : backend_(backend), device_(std::move(device)) {}

SegmentCache::Block SegmentPool::allocate(size_t n) {
  if (n > SegmentCache::kMaxRequest)
    throw Unavailable(
        str_cat(device_, " cannot hold ", n, " bytes; reduce the batch size or the model"));
  std::unique_lock<std::mutex> lock(mu_);
  SegmentCache::Block b = cache_.take(n);
  if (b.ptr) return b;
  size_t size = cache_.segment_size(n);
  const size_t exact = SegmentCache::exact_segment_size(n);
  lock.unlock();  // the device calls run without the lock (see the class comment)
  void* ptr = backend_.allocate(size);
  if (!ptr && size > exact) {  // no room for a region: a segment of the request's own size
    size = exact;
    ptr = backend_.allocate(size);
  }
  if (!ptr) {
    if (const size_t freed = free_segments(); freed > 0) {
      DTRAIN_LOG(WARNING) << device_ << ": allocating " << size << " bytes failed; freed " << freed
                          << " bytes of cached segments and retrying";
      ptr = backend_.allocate(size);
    }
  }
  if (!ptr) {
    const auto [free_b, total_b] = backend_.memory_info();
    lock.lock();
    throw Unavailable(str_cat(device_, " is out of memory: allocating ", size,
                              " bytes failed with ", free_b >> 20, " MiB free of ", total_b >> 20,
                              " MiB (dtrain holds ", cache_.reserved() >> 20, " MiB, ",
                              cache_.cached() >> 20,
                              " MiB of it free in pieces); reduce the batch size or the model, "
                              "or use more devices"));
  }
  lock.lock();
  // Another thread may have freed a block that fits meanwhile; the new segment is cached either
  // way.
  cache_.add_segment(ptr, size, n);
  b = cache_.take(n);
  DTRAIN_CHECK(b.ptr, "SegmentPool: a new segment did not serve its request");
  return b;
}

void SegmentPool::release(void* ptr, size_t size) {
  std::lock_guard<std::mutex> lock(mu_);
  cache_.put(ptr, size);
}

size_t SegmentPool::free_segments() {
  std::vector<SegmentCache::Block> segments;
  {
    std::lock_guard<std::mutex> lock(mu_);
    segments = cache_.take_free_segments();  // out of the books: nobody can take them now
  }
  if (segments.empty()) return 0;
  try {
    backend_.synchronize();  // queued work may still use a cached block
  } catch (...) {
    std::lock_guard<std::mutex> lock(mu_);
    cache_.put_back_segments(segments);
    throw;
  }
  size_t bytes = 0;
  std::exception_ptr first;
  for (const auto& s : segments) {
    try {
      backend_.free(s.ptr);
      bytes += s.size;
    } catch (...) {
      if (!first) first = std::current_exception();
    }
  }
  if (first) std::rethrow_exception(first);
  return bytes;
}

size_t SegmentPool::reserved() {
  std::lock_guard<std::mutex> lock(mu_);
  return cache_.reserved();
}

size_t SegmentPool::cached() {
  std::lock_guard<std::mutex> lock(mu_);
  return cache_.cached();
}

size_t SegmentPool::peak_reserved() {
  std::lock_guard<std::mutex> lock(mu_);
  return cache_.peak_reserved();
}

}  // namespace dtrain::detail
