// The state file on disk: the checks before anything is created, the creation (O_DIRECT,
// exclusive lock, preallocation) and the removal. Included by state_file.hpp.
#pragma once

#include <fcntl.h>
#include <sys/file.h>
#include <sys/stat.h>
#include <sys/statfs.h>
#include <sys/statvfs.h>
#include <unistd.h>

#include <cerrno>
#include <cstdint>
#include <cstring>
#include <filesystem>
#include <optional>
#include <string>
#include <utility>

#include "zenflow/error.hpp"

namespace zenflow::detail {

inline constexpr long tmpfs_magic = 0x01021994;  // linux/magic.h TMPFS_MAGIC
inline constexpr long ramfs_magic = 0x858458f6;  // linux/magic.h RAMFS_MAGIC

/// An open, locked, preallocated scratch file; closes it and, unless kept, removes it.
class scratch_file {
 public:
  scratch_file() noexcept = default;
  scratch_file(int fd, std::string path, bool keep) noexcept : fd_(fd), path_(std::move(path)), keep_(keep) {}
  scratch_file(const scratch_file&) = delete;
  scratch_file& operator=(const scratch_file&) = delete;
  scratch_file(scratch_file&& o) noexcept
      : fd_(std::exchange(o.fd_, -1)), path_(std::move(o.path_)), keep_(o.keep_), direct_(o.direct_) {}
  scratch_file& operator=(scratch_file&& o) noexcept {
    if (this != &o) {
      close_and_remove();
      fd_ = std::exchange(o.fd_, -1);
      path_ = std::move(o.path_);
      keep_ = o.keep_;
      direct_ = o.direct_;
    }
    return *this;
  }
  ~scratch_file() { close_and_remove(); }

  [[nodiscard]] int fd() const noexcept { return fd_; }
  [[nodiscard]] const std::string& path() const noexcept { return path_; }
  [[nodiscard]] bool direct() const noexcept { return direct_; }
  void set_direct(bool d) noexcept { direct_ = d; }
  void set_keep(bool k) noexcept { keep_ = k; }

  void close_and_remove() noexcept {
    if (fd_ < 0) return;
    if (!keep_) (void)::unlink(path_.c_str());
    (void)::close(fd_);  // also releases the flock
    fd_ = -1;
  }

 private:
  int fd_ = -1;
  std::string path_;
  bool keep_ = false;
  bool direct_ = true;
};

/// `directory` exists, is a directory, can be written (the file is created in it later: a
/// read-only mount or missing permission fails here, not at the first step) and is not
/// memory-backed (unless allowed). Throws zenflow::error naming the config field.
inline void check_state_directory(const std::string& directory, bool allow_memory_backed) {
  struct stat ds {};
  if (::stat(directory.c_str(), &ds) != 0) {
    const int err = errno;
    throw error("directory", concat(directory, ": ",
                                    err == ENOENT ? std::string("does not exist (create it first)") : errno_text(err)));
  }
  expects(S_ISDIR(ds.st_mode), "directory", directory, " is not a directory (a file is in the way)");
  if (::access(directory.c_str(), W_OK | X_OK) != 0) {
    const int err = errno;
    throw error("directory",
                concat(directory, " is not writable: ", errno_text(err), " (the state file is created there)"));
  }

  struct statfs fs {};
  if (::statfs(directory.c_str(), &fs) == 0 && !allow_memory_backed) {
    const long type = static_cast<long>(fs.f_type);
    expects(type != tmpfs_magic && type != ramfs_magic, "directory", directory, " is on ",
            type == tmpfs_magic ? "tmpfs" : "ramfs",
            ", a memory-backed file system: optimizer state there would occupy the RAM the NVMe tier is meant to "
            "free; choose a directory on an SSD (allow_memory_backed = true accepts it)");
  }
}

/// The checks before anything is created: check_state_directory, the target is not a directory or
/// special file, and the file system has `need` bytes free (counting what an existing file at the
/// target, which will be truncated, already holds; a file system that reports no capacity, as
/// ramfs, is not checked). Throws zenflow::error naming the config field.
inline void check_before_create(const std::string& directory, const std::string& path, std::uint64_t need,
                                bool allow_memory_backed) {
  check_state_directory(directory, allow_memory_backed);

  std::uint64_t reclaimable = 0;
  struct stat ts {};
  if (::lstat(path.c_str(), &ts) == 0) {
    expects(!S_ISDIR(ts.st_mode), "file_name", path, " is a directory (a directory is in the way)");
    expects(S_ISREG(ts.st_mode), "file_name", path, " exists and is not a regular file (",
            S_ISLNK(ts.st_mode) ? "a symbolic link" : "a special file", "): remove it or choose another file_name");
    reclaimable = static_cast<std::uint64_t>(ts.st_blocks) * 512u;  // freed when it is truncated
  }

  struct statvfs vfs {};
  if (::statvfs(directory.c_str(), &vfs) != 0)
    throw error("directory", concat("statvfs of ", directory, " failed: ", errno_text(errno)));
  if (vfs.f_blocks == 0) return;  // reports no capacity (ramfs): nothing to check against
  const std::uint64_t free_bytes = static_cast<std::uint64_t>(vfs.f_bavail) * vfs.f_frsize;
  expects(need <= free_bytes + reclaimable, "bytes", path, " needs ", need, " bytes but its file system has ",
          free_bytes, " bytes free", reclaimable > 0 ? concat(" (+", reclaimable, " held by the old file there)") : "",
          " (statvfs): disk full, nothing was written");
}

/// Preallocates bytes [offset, offset + size) of an open file (zero-filled, extending it). Throws
/// zenflow::error: disk full names the path, the bytes needed and the bytes free. On failure the
/// file is as it was: a file system that ran out of space part way (ext4 keeps the blocks a failed
/// fallocate got) has them released again, so that one oversized request does not leave the disk
/// full for every other writer.
inline void preallocate(int fd, const std::string& directory, const std::string& path, std::uint64_t offset,
                        std::uint64_t size) {
  const auto free_bytes = [&]() -> std::optional<std::uint64_t> {
    struct statvfs vfs {};
    if (::fstatvfs(fd, &vfs) != 0 || vfs.f_blocks == 0) return std::nullopt;  // (ramfs reports no capacity)
    return static_cast<std::uint64_t>(vfs.f_bavail) * vfs.f_frsize;
  };
  const auto disk_full = [&](std::uint64_t available, const std::string& how) {
    return error("bytes", concat(path, " needs ", size, " bytes but its file system has ", available, " bytes free (",
                                 how, "): disk full"));
  };
  // Not even tried when it cannot fit (a failed fallocate may take the free space before failing).
  if (const auto available = free_bytes(); available && size > *available) throw disk_full(*available, "statvfs");
  int rc = 0;
  do {
    rc = ::fallocate(fd, 0, static_cast<off_t>(offset), static_cast<off_t>(size));
  } while (rc != 0 && errno == EINTR);
  if (rc != 0) {
    const int err = errno;
    // Give back what the failed call allocated: the size it may have reached, and blocks past it.
    struct stat st {};
    if (::fstat(fd, &st) == 0 && static_cast<std::uint64_t>(st.st_size) > offset)
      (void)::ftruncate(fd, static_cast<off_t>(offset));
    (void)::fallocate(fd, FALLOC_FL_PUNCH_HOLE | FALLOC_FL_KEEP_SIZE, static_cast<off_t>(offset),
                      static_cast<off_t>(size));
    if (err == ENOSPC) throw disk_full(free_bytes().value_or(0), concat("fallocate: ", errno_text(err)));
    if (err == EOPNOTSUPP)
      throw error("directory", concat("the file system of ", directory, " cannot preallocate files (fallocate: ",
                                      errno_text(err), "); choose a directory on ext4, xfs or btrfs"));
    if (err == EFBIG)
      throw error("bytes", concat(size, " bytes exceed the largest file allowed for ", path,
                                  " (fallocate: ", errno_text(err), "; RLIMIT_FSIZE or the file system's limit)"));
    throw error("bytes",
                concat("preallocating ", size, " bytes for ", path, " failed (fallocate: ", errno_text(err), ")"));
  }
}

/// Creates (or truncates) the file, locks it against other processes, preallocates `size` bytes.
/// O_DIRECT unless the file system refuses it and `fallback_to_buffered` allows buffered I/O;
/// the result says which. On failure nothing is left behind. Throws zenflow::error.
inline scratch_file create_scratch(const std::string& directory, const std::string& path, std::uint64_t size,
                                   std::size_t block_bytes, bool fallback_to_buffered, bool keep, std::string& note) {
  constexpr int flags = O_RDWR | O_CLOEXEC;
  bool direct = true;
  bool created = true;
  int fd = ::open(path.c_str(), flags | O_CREAT | O_EXCL | O_DIRECT, 0600);
  if (fd < 0 && errno == EEXIST) {
    created = false;
    fd = ::open(path.c_str(), flags | O_DIRECT | O_NOFOLLOW);
  }
  if (fd < 0 && errno == EINVAL) {  // the file system refuses O_DIRECT
    const std::string why = errno_text(EINVAL);
    if (created) (void)::unlink(path.c_str());  // O_CREAT may have created it before O_DIRECT was refused
    expects(fallback_to_buffered, "directory", "the file system of ", directory, " refuses O_DIRECT (open: ", why,
            "); choose a directory on a local disk file system (ext4, xfs) or set direct_io::fallback_to_buffered");
    direct = false;
    note = "buffered I/O: the file system refuses O_DIRECT (" + why + ")";
    created = true;
    fd = ::open(path.c_str(), flags | O_CREAT | O_EXCL, 0600);
    if (fd < 0 && errno == EEXIST) {
      created = false;
      fd = ::open(path.c_str(), flags | O_NOFOLLOW);
    }
  }
  if (fd < 0) {
    const int err = errno;
    throw error("directory", concat("cannot create ", path, ": ", errno_text(err),
                                    err == EACCES || err == EPERM || err == EROFS
                                        ? std::string("; the directory is not writable by this process")
                                        : std::string()));
  }
  scratch_file file(fd, path, /*keep=*/!created);  // an existing file is not removed before it is ours
  file.set_direct(direct);
  if (::flock(fd, LOCK_EX | LOCK_NB) != 0) {
    const int err = errno;
    throw error("file_name", concat(path, " is in use by another process (flock: ", errno_text(err),
                                    "): each rank needs its own file"));
  }
  file.set_keep(keep);  // locked: from here the file is this object's scratch
  if (::ftruncate(fd, 0) != 0) throw error("file_name", concat("truncating ", path, " failed: ", errno_text(errno)));
#if defined(STATX_DIOALIGN)
  if (direct) {
    struct statx sx {};
    if (::statx(fd, "", AT_EMPTY_PATH, STATX_DIOALIGN, &sx) == 0 && (sx.stx_mask & STATX_DIOALIGN) != 0 &&
        sx.stx_dio_offset_align > 0) {
      expects(block_bytes % sx.stx_dio_offset_align == 0, "block_bytes", block_bytes,
              " is not a multiple of the file system's O_DIRECT alignment ", sx.stx_dio_offset_align);
      expects(sx.stx_dio_mem_align <= 4096, "directory", "the file system of ", directory,
              " needs O_DIRECT buffers aligned to ", sx.stx_dio_mem_align, " bytes (the pool aligns to 4096)");
    }
  }
#else
  (void)block_bytes;
#endif
  preallocate(fd, directory, path, 0, size);
  return file;
}

}  // namespace zenflow::detail
