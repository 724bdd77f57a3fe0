// CUDA memory and handles: the one place in zenflow that allocates and frees them.
//
//   cuda_device_buffer       cudaMalloc / cudaFree (which synchronizes): device memory of a size
//   cuda_device_array<T>     the same, typed: `size()` values of T
//   cuda_async_buffer        cudaMallocAsync / cudaFreeAsync on one stream: stream-ordered scratch
//   cuda_host_buffer         cudaHostAlloc(flags) / cudaFreeHost: page-locked host memory, with
//                            its device pointer when the flags include cudaHostAllocMapped
//   cuda_mapped_host_buffer  cuda_host_buffer with cudaHostAllocMapped (kernels write it in place)
//   cuda_host_registration   cudaHostRegister / cudaHostUnregister of memory owned elsewhere
//   cuda_event               cudaEventCreateWithFlags on first use / cudaEventDestroy
//   cuda_stream              cudaStreamCreateWithFlags / cudaStreamDestroy
//   cuda_device_scope        cudaSetDevice for a scope, the previous device restored after it
//
// Every owner is move-only and releases exactly once: by its destructor, reset() or a
// move-assignment (which releases what it held first); a moved-from owner holds nothing. A size of
// 0 allocates nothing (data() is nullptr). Failed CUDA calls throw zenflow::cuda_error
// (ZENFLOW_CUDA_TRY) and leave nothing allocated; releases never throw (ZENFLOW_CUDA_ASSERT).
// A destructor waits for nothing beyond what its CUDA call itself waits for: an owner of memory
// that a copy or kernel may still use must synchronize first (the transfer queue waits for its
// slot events, the uploader for its slots).
//
// Not a public header: the components (and the tests and benchmarks) build their state from these.
#pragma once

#include <cuda_runtime.h>

#include <cstddef>
#include <utility>

#include "zenflow/error.hpp"

namespace zenflow::detail {

/// Device memory from cudaMalloc, freed with cudaFree (which synchronizes the device).
class cuda_device_buffer {
 public:
  cuda_device_buffer() noexcept = default;
  /// cudaMalloc of `bytes` (nothing for 0). Throws zenflow::cuda_error. May synchronize.
  explicit cuda_device_buffer(std::size_t bytes) {
    if (bytes == 0) return;
    ZENFLOW_CUDA_TRY(cudaMalloc(&data_, bytes));
    bytes_ = bytes;
  }
  cuda_device_buffer(const cuda_device_buffer&) = delete;
  cuda_device_buffer& operator=(const cuda_device_buffer&) = delete;
  cuda_device_buffer(cuda_device_buffer&& other) noexcept
      : data_(std::exchange(other.data_, nullptr)), bytes_(std::exchange(other.bytes_, 0)) {}
  cuda_device_buffer& operator=(cuda_device_buffer&& other) noexcept {
    if (this != &other) {
      reset();
      data_ = std::exchange(other.data_, nullptr);
      bytes_ = std::exchange(other.bytes_, 0);
    }
    return *this;
  }
  ~cuda_device_buffer() { reset(); }

  /// The memory as T* (std::byte* by default); nullptr when empty.
  template <class T = std::byte>
  [[nodiscard]] T* data() const noexcept {
    return static_cast<T*>(data_);
  }
  [[nodiscard]] std::size_t bytes() const noexcept { return bytes_; }
  explicit operator bool() const noexcept { return data_ != nullptr; }

  /// Frees now (cudaFree); idempotent, never throws.
  void reset() noexcept {
    if (data_ != nullptr) ZENFLOW_CUDA_ASSERT(cudaFree(data_));
    data_ = nullptr;
    bytes_ = 0;
  }

 private:
  void* data_ = nullptr;
  std::size_t bytes_ = 0;
};

/// `size()` values of T in device memory: a cuda_device_buffer of size() * sizeof(T) bytes.
template <class T>
class cuda_device_array {
 public:
  cuda_device_array() noexcept = default;
  /// cudaMalloc of `count` values (nothing for 0). Throws zenflow::cuda_error. May synchronize.
  explicit cuda_device_array(std::size_t count) : buffer_(count * sizeof(T)) {}

  [[nodiscard]] T* data() const noexcept { return buffer_.data<T>(); }
  [[nodiscard]] std::size_t size() const noexcept { return buffer_.bytes() / sizeof(T); }
  [[nodiscard]] std::size_t bytes() const noexcept { return buffer_.bytes(); }
  explicit operator bool() const noexcept { return static_cast<bool>(buffer_); }
  void reset() noexcept { buffer_.reset(); }

 private:
  cuda_device_buffer buffer_;
};

/// Stream-ordered device scratch: cudaMallocAsync on `stream`, cudaFreeAsync on the same stream
/// when released, so the memory stays valid for the work enqueued on that stream before the
/// release. Neither call synchronizes.
class cuda_async_buffer {
 public:
  cuda_async_buffer() noexcept = default;
  /// cudaMallocAsync of `bytes` on `stream` (nothing for 0). Throws zenflow::cuda_error.
  cuda_async_buffer(std::size_t bytes, cudaStream_t stream) : stream_(stream) {
    if (bytes == 0) return;
    ZENFLOW_CUDA_TRY(cudaMallocAsync(&data_, bytes, stream));
    bytes_ = bytes;
  }
  cuda_async_buffer(const cuda_async_buffer&) = delete;
  cuda_async_buffer& operator=(const cuda_async_buffer&) = delete;
  cuda_async_buffer(cuda_async_buffer&& other) noexcept
      : data_(std::exchange(other.data_, nullptr)), bytes_(std::exchange(other.bytes_, 0)), stream_(other.stream_) {}
  cuda_async_buffer& operator=(cuda_async_buffer&& other) noexcept {
    if (this != &other) {
      reset();
      data_ = std::exchange(other.data_, nullptr);
      bytes_ = std::exchange(other.bytes_, 0);
      stream_ = other.stream_;
    }
    return *this;
  }
  ~cuda_async_buffer() { reset(); }

  template <class T = std::byte>
  [[nodiscard]] T* data() const noexcept {
    return static_cast<T*>(data_);
  }
  [[nodiscard]] std::size_t bytes() const noexcept { return bytes_; }
  /// The stream the allocation and the free are ordered on.
  [[nodiscard]] cudaStream_t stream() const noexcept { return stream_; }
  explicit operator bool() const noexcept { return data_ != nullptr; }

  /// Enqueues the free on stream() (cudaFreeAsync); idempotent, never throws.
  void reset() noexcept {
    if (data_ != nullptr) ZENFLOW_CUDA_ASSERT(cudaFreeAsync(data_, stream_));
    data_ = nullptr;
    bytes_ = 0;
  }

 private:
  void* data_ = nullptr;
  std::size_t bytes_ = 0;
  cudaStream_t stream_ = nullptr;
};

/// Page-locked host memory from cudaHostAlloc, freed with cudaFreeHost. With cudaHostAllocMapped
/// in the flags, device_data() is the same memory's address for kernels (cudaHostGetDevicePointer);
/// otherwise it is nullptr.
class cuda_host_buffer {
 public:
  cuda_host_buffer() noexcept = default;
  /// cudaHostAlloc(bytes, flags) (nothing for 0); cudaHostAllocDefault is cudaMallocHost. Throws
  /// zenflow::cuda_error, freeing what it allocated. May synchronize (allocate up front).
  explicit cuda_host_buffer(std::size_t bytes, unsigned flags = cudaHostAllocDefault) : flags_(flags) {
    if (bytes == 0) return;
    ZENFLOW_CUDA_TRY(cudaHostAlloc(&data_, bytes, flags));
    bytes_ = bytes;
    if ((flags & cudaHostAllocMapped) != 0) {
      try {
        ZENFLOW_CUDA_TRY(cudaHostGetDevicePointer(&device_data_, data_, 0));
      } catch (...) {
        reset();
        throw;
      }
    }
  }
  cuda_host_buffer(const cuda_host_buffer&) = delete;
  cuda_host_buffer& operator=(const cuda_host_buffer&) = delete;
  cuda_host_buffer(cuda_host_buffer&& other) noexcept
      : data_(std::exchange(other.data_, nullptr)),
        device_data_(std::exchange(other.device_data_, nullptr)),
        bytes_(std::exchange(other.bytes_, 0)),
        flags_(other.flags_) {}
  cuda_host_buffer& operator=(cuda_host_buffer&& other) noexcept {
    if (this != &other) {
      reset();
      data_ = std::exchange(other.data_, nullptr);
      device_data_ = std::exchange(other.device_data_, nullptr);
      bytes_ = std::exchange(other.bytes_, 0);
      flags_ = other.flags_;
    }
    return *this;
  }
  ~cuda_host_buffer() { reset(); }

  /// The memory for the host, as T* (std::byte* by default).
  template <class T = std::byte>
  [[nodiscard]] T* data() const noexcept {
    return static_cast<T*>(data_);
  }
  /// The memory for kernels (mapped buffers only; nullptr otherwise).
  template <class T = std::byte>
  [[nodiscard]] T* device_data() const noexcept {
    return static_cast<T*>(device_data_);
  }
  [[nodiscard]] std::size_t bytes() const noexcept { return bytes_; }
  /// The cudaHostAlloc flags.
  [[nodiscard]] unsigned flags() const noexcept { return flags_; }
  explicit operator bool() const noexcept { return data_ != nullptr; }

  /// Frees now (cudaFreeHost); idempotent, never throws.
  void reset() noexcept {
    if (data_ != nullptr) ZENFLOW_CUDA_ASSERT(cudaFreeHost(data_));
    data_ = device_data_ = nullptr;
    bytes_ = 0;
  }

 private:
  void* data_ = nullptr;
  void* device_data_ = nullptr;
  std::size_t bytes_ = 0;
  unsigned flags_ = cudaHostAllocDefault;
};

/// Mapped pinned host memory (cudaHostAlloc with cudaHostAllocMapped): data() for the host,
/// device_data() for kernels, which read and write it in place.
class cuda_mapped_host_buffer : public cuda_host_buffer {
 public:
  cuda_mapped_host_buffer() noexcept = default;
  /// Allocates `bytes` (nothing for 0). Throws zenflow::cuda_error. May synchronize.
  explicit cuda_mapped_host_buffer(std::size_t bytes) : cuda_host_buffer(bytes, cudaHostAllocMapped) {}
};

/// Page-locks host memory that something else owns: cudaHostRegister(data, bytes, flags), undone
/// with cudaHostUnregister. The memory must outlive the registration.
class cuda_host_registration {
 public:
  cuda_host_registration() noexcept = default;
  /// Throws zenflow::cuda_error (nothing stays registered). May synchronize.
  cuda_host_registration(void* data, std::size_t bytes, unsigned flags) {
    ZENFLOW_CUDA_TRY(cudaHostRegister(data, bytes, flags));
    data_ = data;
  }
  cuda_host_registration(const cuda_host_registration&) = delete;
  cuda_host_registration& operator=(const cuda_host_registration&) = delete;
  cuda_host_registration(cuda_host_registration&& other) noexcept : data_(std::exchange(other.data_, nullptr)) {}
  cuda_host_registration& operator=(cuda_host_registration&& other) noexcept {
    if (this != &other) {
      reset();
      data_ = std::exchange(other.data_, nullptr);
    }
    return *this;
  }
  ~cuda_host_registration() { reset(); }

  [[nodiscard]] void* data() const noexcept { return data_; }
  explicit operator bool() const noexcept { return data_ != nullptr; }

  /// Unregisters now (cudaHostUnregister); idempotent, never throws.
  void reset() noexcept {
    if (data_ != nullptr) ZENFLOW_CUDA_ASSERT(cudaHostUnregister(data_));
    data_ = nullptr;
  }

 private:
  void* data_ = nullptr;
};

/// A CUDA event, created with its flags on first use (get(), create() or record()) on the device
/// current then. The default flags are cudaEventDisableTiming; add cudaEventBlockingSync for
/// waiters that sleep, use cudaEventDefault for a timing event.
class cuda_event {
 public:
  cuda_event() noexcept = default;
  explicit cuda_event(unsigned flags) noexcept : flags_(flags) {}
  cuda_event(const cuda_event&) = delete;
  cuda_event& operator=(const cuda_event&) = delete;
  cuda_event(cuda_event&& other) noexcept : event_(std::exchange(other.event_, nullptr)), flags_(other.flags_) {}
  cuda_event& operator=(cuda_event&& other) noexcept {
    if (this != &other) {
      reset();
      event_ = std::exchange(other.event_, nullptr);
      flags_ = other.flags_;
    }
    return *this;
  }
  ~cuda_event() { reset(); }

  /// Creates the event now unless it exists (cudaEventCreateWithFlags). Throws zenflow::cuda_error.
  void create() {
    if (event_ == nullptr) ZENFLOW_CUDA_TRY(cudaEventCreateWithFlags(&event_, flags_));
  }
  /// The event, created first if needed.
  [[nodiscard]] cudaEvent_t get() {
    create();
    return event_;
  }
  /// The event, or nullptr while it was never created.
  [[nodiscard]] cudaEvent_t native() const noexcept { return event_; }
  [[nodiscard]] bool created() const noexcept { return event_ != nullptr; }
  [[nodiscard]] unsigned flags() const noexcept { return flags_; }

  /// Captures the work enqueued on `stream` so far (cudaEventRecord). Asynchronous.
  void record(cudaStream_t stream) { ZENFLOW_CUDA_TRY(cudaEventRecord(get(), stream)); }
  /// Work enqueued on `stream` after this call waits for the last record (cudaStreamWaitEvent).
  /// Never blocks the host; nothing to wait for while the event was never created.
  void wait(cudaStream_t stream) const {
    if (event_ != nullptr) ZENFLOW_CUDA_TRY(cudaStreamWaitEvent(stream, event_, 0));
  }
  /// Blocks until the last record completed (cudaEventSynchronize); returns at once while the
  /// event was never created.
  void synchronize() const {
    if (event_ != nullptr) ZENFLOW_CUDA_TRY(cudaEventSynchronize(event_));
  }
  /// True when the last record completed (or there was none). Does not block. cudaErrorNotReady is
  /// no error: should the runtime keep it as the thread's last error, it is cleared, so that a
  /// later cudaGetLastError() after a launch does not report it.
  [[nodiscard]] bool query() const {
    if (event_ == nullptr) return true;
    const cudaError_t status = cudaEventQuery(event_);
    if (status == cudaErrorNotReady) {
      if (cudaPeekAtLastError() == cudaErrorNotReady) (void)cudaGetLastError();
      return false;
    }
    ZENFLOW_CUDA_TRY(status);
    return true;
  }

  /// Destroys the event now (cudaEventDestroy; a pending record still completes); idempotent,
  /// never throws. A later use creates a new one.
  void reset() noexcept {
    if (event_ != nullptr) ZENFLOW_CUDA_ASSERT(cudaEventDestroy(event_));
    event_ = nullptr;
  }

 private:
  cudaEvent_t event_ = nullptr;
  unsigned flags_ = cudaEventDisableTiming;
};

/// A CUDA stream of the device current at construction. cudaStreamNonBlocking by default: no
/// implicit synchronization with the legacy default stream. A moved-from stream holds nullptr,
/// which CUDA calls read as the legacy default stream: do not enqueue on it.
class cuda_stream {
 public:
  /// cudaStreamCreateWithFlags. Throws zenflow::cuda_error.
  explicit cuda_stream(unsigned flags = cudaStreamNonBlocking) {
    ZENFLOW_CUDA_TRY(cudaStreamCreateWithFlags(&stream_, flags));
  }
  cuda_stream(const cuda_stream&) = delete;
  cuda_stream& operator=(const cuda_stream&) = delete;
  cuda_stream(cuda_stream&& other) noexcept : stream_(std::exchange(other.stream_, nullptr)) {}
  cuda_stream& operator=(cuda_stream&& other) noexcept {
    if (this != &other) {
      reset();
      stream_ = std::exchange(other.stream_, nullptr);
    }
    return *this;
  }
  ~cuda_stream() { reset(); }

  [[nodiscard]] cudaStream_t get() const noexcept { return stream_; }
  explicit operator bool() const noexcept { return stream_ != nullptr; }
  /// Blocks until the work enqueued so far completed (cudaStreamSynchronize).
  void synchronize() const { ZENFLOW_CUDA_TRY(cudaStreamSynchronize(stream_)); }

  /// Destroys the stream now (cudaStreamDestroy: its pending work still completes); idempotent,
  /// never throws.
  void reset() noexcept {
    if (stream_ != nullptr) ZENFLOW_CUDA_ASSERT(cudaStreamDestroy(stream_));
    stream_ = nullptr;
  }

 private:
  cudaStream_t stream_ = nullptr;
};

/// Makes `device` the calling thread's current device for its scope and restores the previous one
/// (no call when it is current already). Throws zenflow::cuda_error if it cannot switch.
class cuda_device_scope {
 public:
  explicit cuda_device_scope(int device) : device_(device) {
    ZENFLOW_CUDA_TRY(cudaGetDevice(&previous_));
    if (previous_ != device_) ZENFLOW_CUDA_TRY(cudaSetDevice(device_));
  }
  cuda_device_scope(const cuda_device_scope&) = delete;
  cuda_device_scope& operator=(const cuda_device_scope&) = delete;
  ~cuda_device_scope() {
    if (previous_ != device_) ZENFLOW_CUDA_ASSERT(cudaSetDevice(previous_));
  }

 private:
  int device_;
  int previous_ = 0;
};

}  // namespace zenflow::detail
