// any_io_engine's definitions: a virtual interface over any io_engine model. One indirect call
// per request is nothing next to a block transfer. Included by io_engine.hpp.
#pragma once

#include <memory>
#include <string>
#include <utility>

namespace zenflow {

struct any_io_engine::base {
  virtual ~base() = default;
  [[nodiscard]] virtual std::string_view name() const noexcept = 0;
  [[nodiscard]] virtual std::string status() const = 0;
  [[nodiscard]] virtual std::size_t queue_depth() const noexcept = 0;
  [[nodiscard]] virtual std::size_t in_flight() const noexcept = 0;
  virtual std::uint32_t add_file(int fd, std::string_view path) = 0;
  virtual void remove_file(std::uint32_t file) = 0;
  virtual bool register_buffers(std::span<const std::span<std::byte>> buffers) = 0;
  virtual void submit(const io_request& request) = 0;
  virtual std::size_t wait(std::span<io_completion> out, std::size_t min) = 0;
  [[nodiscard]] virtual std::string describe(const io_completion& c) const = 0;
};

template <class E>
struct any_io_engine::model final : any_io_engine::base {
  E e;
  explicit model(E&& engine) : e(std::move(engine)) {}
  std::string_view name() const noexcept override { return e.name(); }
  std::string status() const override { return e.status(); }
  std::size_t queue_depth() const noexcept override { return e.queue_depth(); }
  std::size_t in_flight() const noexcept override { return e.in_flight(); }
  std::uint32_t add_file(int fd, std::string_view path) override { return e.add_file(fd, path); }
  void remove_file(std::uint32_t file) override { e.remove_file(file); }
  bool register_buffers(std::span<const std::span<std::byte>> buffers) override { return e.register_buffers(buffers); }
  void submit(const io_request& request) override { e.submit(request); }
  std::size_t wait(std::span<io_completion> out, std::size_t min) override { return e.wait(out, min); }
  std::string describe(const io_completion& c) const override { return e.describe(c); }
};

template <class E>
requires(!std::same_as<std::remove_cvref_t<E>, any_io_engine> &&
         io_engine<E>) any_io_engine::any_io_engine(E engine, std::string note)
    : p_(std::make_unique<model<E>>(std::move(engine))), note_(std::move(note)) {}

inline any_io_engine::any_io_engine(any_io_engine&&) noexcept = default;
inline any_io_engine& any_io_engine::operator=(any_io_engine&&) noexcept = default;
inline any_io_engine::~any_io_engine() = default;

inline std::string_view any_io_engine::name() const noexcept {
  return p_->name();
}
inline std::string any_io_engine::status() const {
  return note_.empty() ? p_->status() : p_->status() + "; " + note_;
}
inline std::size_t any_io_engine::queue_depth() const noexcept {
  return p_->queue_depth();
}
inline std::size_t any_io_engine::in_flight() const noexcept {
  return p_->in_flight();
}
inline std::uint32_t any_io_engine::add_file(int fd, std::string_view path) {
  return p_->add_file(fd, path);
}
inline void any_io_engine::remove_file(std::uint32_t file) {
  p_->remove_file(file);
}
inline bool any_io_engine::register_buffers(std::span<const std::span<std::byte>> buffers) {
  return p_->register_buffers(buffers);
}
inline void any_io_engine::submit(const io_request& request) {
  p_->submit(request);
}
inline std::size_t any_io_engine::wait(std::span<io_completion> out, std::size_t min) {
  return p_->wait(out, min);
}
inline std::string any_io_engine::describe(const io_completion& c) const {
  return p_->describe(c);
}

}  // namespace zenflow
