// zenflow.torch._C: the coordinator for torch tensors.
//
// The Python layer (zenflow/torch/optim.py) validates its arguments and names them; this module
// turns tensors into zenflow views (the host-framework contract: pointer, extents, strides, dtype,
// memory space) and forwards to the coordinator handle of the tensors' backend. A zenflow::error
// reaches Python as zenflow.torch.ZenFlowError (a ValueError).
//
// Columns: a 2-D parameter is seen as W[rows, cols] whose *columns* are its input channels.
//   column_dim 1 (nn.Linear.weight [out, in], any other 2-D or flattened N-D weight): a column is
//     W[:, j], strided -- matrix_view row_major(out, in).
//   column_dim 0 (nn.Embedding.weight [num_embeddings, dim]): a column is one embedding, W[j, :],
//     contiguous -- matrix_view column_contiguous(rows = dim, cols = num_embeddings).
#include <torch/extension.h>

#include <cstdint>
#include <initializer_list>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "coordinator_handle.hpp"
#include "process_group_communicator.hpp"
#include "zenflow/detail/state_file/scratch_file.hpp"
#include "zenflow/version.hpp"

namespace py = pybind11;

#ifndef ZENFLOW_TORCH_CUDA_REASON
#define ZENFLOW_TORCH_CUDA_REASON ""
#endif

#ifndef ZENFLOW_TORCH_NCCL_REASON
#define ZENFLOW_TORCH_NCCL_REASON ""
#endif

namespace zenflow_torch {

#ifndef ZENFLOW_TORCH_WITH_CUDA
// This build has no CUDA backend (cuda_coordinator.cu is not compiled): its entry points say why.
std::unique_ptr<handle> make_cuda_handle(const zenflow::zenflow_options&, const zenflow::coordinator_config&) {
  throw zenflow::error("device",
                       std::string("zenflow.torch was built without its CUDA backend: ") + ZENFLOW_TORCH_CUDA_REASON);
}
std::vector<std::byte> make_nccl_unique_id() {
  (void)make_cuda_handle({}, {});  // throws
  return {};
}
std::unique_ptr<handle> make_cuda_data_parallel_handle(const zenflow::zenflow_options& options,
                                                       const zenflow::coordinator_config& config,
                                                       std::span<const std::byte>, int, int, std::chrono::milliseconds,
                                                       std::shared_ptr<zenflow::abort_channel>) {
  return make_cuda_handle(options, config);  // throws
}
#endif

namespace {

#ifdef ZENFLOW_TORCH_WITH_CUDA
constexpr bool with_cuda = true;
#else
constexpr bool with_cuda = false;
#endif
#ifdef ZENFLOW_TORCH_WITH_NCCL
constexpr bool with_nccl = true;
#else
constexpr bool with_nccl = false;
#endif
/// Why data parallel on CUDA tensors is not available ("" when it is).
const char* with_nccl_reason() {
  if (with_nccl) return "";
  return with_cuda ? ZENFLOW_TORCH_NCCL_REASON : "no CUDA backend";
}

zenflow::dtype to_dtype(const at::Tensor& t, const char* argument) {
  switch (t.scalar_type()) {
    case at::kFloat:
      return zenflow::dtype::f32;
    case at::kBFloat16:
      return zenflow::dtype::bf16;
    case at::kHalf:
      return zenflow::dtype::f16;
    default:
      throw zenflow::error(argument, std::string("dtype ") + c10::toString(t.scalar_type()) +
                                         " is not supported (float32, bfloat16, float16)");
  }
}

zenflow::memory_space to_space(const at::Tensor& t) {
  return t.is_cuda() ? zenflow::memory_space::device : zenflow::memory_space::host;
}

template <class T>
T get(const py::dict& d, const char* key) {
  zenflow::expects(d.contains(key), key, "missing");
  return d[key].cast<T>();
}

zenflow::interval_option to_interval(const py::dict& d, const char* key) {
  zenflow::expects(d.contains(key), key, "missing");
  py::object v = d[key];
  if (py::isinstance<py::str>(v)) {
    zenflow::expects(v.cast<std::string>() == "auto", key, "must be \"auto\" or an integer");
    return zenflow::interval_option::automatic();
  }
  return zenflow::interval_option::fixed(v.cast<std::int64_t>());
}

zenflow::adam_options to_adam(const py::dict& d) {
  zenflow::adam_options a;
  a.lr = get<float>(d, "lr");
  a.beta1 = get<float>(d, "beta1");
  a.beta2 = get<float>(d, "beta2");
  a.eps = get<float>(d, "eps");
  a.weight_decay = get<float>(d, "weight_decay");
  a.adamw_mode = get<bool>(d, "adamw_mode");
  a.validate();
  return a;
}

// The value of d[key] among `values`, by the library's name of each ("must be a, b or c, got x").
template <class Enum>
Enum from_name(const py::dict& d, const char* key, std::initializer_list<Enum> values,
               std::string_view (*name_of)(Enum) noexcept) {
  const auto text = get<std::string>(d, key);
  std::string expected;
  for (std::size_t i = 0; const Enum v : values) {
    if (name_of(v) == text) return v;
    if (i++ > 0) expected += i == values.size() ? " or " : ", ";
    expected += name_of(v);
  }
  throw zenflow::error(key, "must be " + expected + ", got " + text);
}

zenflow::zenflow_options to_options(const py::dict& d) {
  zenflow::zenflow_options o;
  o.mode = from_name(
      d, "mode", {zenflow::offload_mode::zenflow, zenflow::offload_mode::zero_offload, zenflow::offload_mode::dense},
      zenflow::offload_mode_name);
  o.topk_ratio = get<float>(d, "topk_ratio");
  o.select_strategy = from_name(
      d, "select_strategy",
      {zenflow::selection_strategy::automatic, zenflow::selection_strategy::step, zenflow::selection_strategy::epoch},
      zenflow::selection_strategy_name);
  o.select_interval = to_interval(d, "select_interval");
  o.update_interval = to_interval(d, "update_interval");
  o.full_warm_up_rounds = get<std::int64_t>(d, "full_warm_up_rounds");
  o.overlap_step = get<bool>(d, "overlap_step");
  o.steps_per_epoch = get<std::int64_t>(d, "steps_per_epoch");
  o.auto_select_steps = get<std::int64_t>(d, "auto_select_steps");
  o.max_update_interval = get<std::int64_t>(d, "max_update_interval");
  o.max_grad_norm = get<float>(d, "max_grad_norm");
  o.cover_cpu_update = get<bool>(d, "cover_cpu_update");
  o.optimizer = to_adam(get<py::dict>(d, "adam"));
  o.validate();
  return o;
}

zenflow::coordinator_config to_config(const py::dict& d) {
  zenflow::coordinator_config c;
  c.cpu_threads = get<std::size_t>(d, "cpu_threads");
  c.pin_threads = get<bool>(d, "pin_threads");
  c.reserved_cpus = get<std::size_t>(d, "reserved_cpus");
  c.d2h_slot_bytes = get<std::size_t>(d, "d2h_slot_bytes");
  c.d2h_slots = get<std::size_t>(d, "d2h_slots");
  c.h2d_slot_bytes = get<std::size_t>(d, "h2d_slot_bytes");
  c.h2d_slots = get<std::size_t>(d, "h2d_slots");
  c.record_trace = get<bool>(d, "record_trace");
  const auto state = get<std::string>(d, "cpu_state");
  const auto format = zenflow::parse_cpu_state_format(state);
  if (!format) throw zenflow::error("cpu_state", "must be fp32, bf16_moments or blockwise8_moments, got " + state);
  c.cpu_state = *format;
  if (d.contains("nvme") && !d["nvme"].is_none()) {  // zenflow.torch checked the keys and their values
    const auto n = d["nvme"].cast<py::dict>();
    zenflow::nvme_state_config s;
    s.file.directory = get<std::string>(n, "directory");
    if (n.contains("file_name")) s.file.file_name = get<std::string>(n, "file_name");
    s.file.block_bytes = get<std::size_t>(n, "block_bytes");
    s.file.read_ahead = get<std::size_t>(n, "read_ahead");
    s.file.write_behind = get<std::size_t>(n, "write_behind");
    const auto pin = get<std::string>(n, "pin");
    s.file.pin = pin == "required" ? zenflow::pin_policy::required
                 : pin == "none"   ? zenflow::pin_policy::none
                                   : zenflow::pin_policy::automatic;
    const auto engine = get<std::string>(n, "engine");
    s.engine.kind = engine == "io_uring" ? zenflow::io_engine_kind::uring
                    : engine == "posix"  ? zenflow::io_engine_kind::posix
                                         : zenflow::io_engine_kind::automatic;
    s.engine.queue_depth = get<std::size_t>(n, "queue_depth");
    s.engine.threads = get<std::size_t>(n, "threads");
    s.master_on_disk = get<bool>(n, "master_on_disk");
    c.nvme = s;
  }
  return c;
}

py::dict to_dict(const zenflow::host_memory_bytes& m) {
  py::dict d;
  for (const auto& [key, bytes] :
       {std::pair{"cpu_state", m.cpu_state}, std::pair{"accumulators", m.accumulators},
        std::pair{"copy_out", m.copy_out}, std::pair{"state_file_pool", m.state_file_pool},
        std::pair{"device_buffers", m.device_buffers}, std::pair{"host_total", m.host_total()}})
    d[key] = bytes;
  return d;
}

py::dict to_dict(const zenflow::step_metrics& m) {
  py::dict d;
  d["step"] = m.step;
  d["stall_seconds"] = m.stall_seconds;
  d["stall_reason"] = m.stall_reason;
  d["cpu_update_seconds"] = m.cpu_update_seconds;
  d["bytes_device_to_host"] = m.bytes_device_to_host;
  d["bytes_host_to_device"] = m.bytes_host_to_device;
  d["selection_overlap"] = m.selection_overlap;
  d["interval"] = m.interval;
  d["interval_floor"] = m.interval_floor;
  d["reselected"] = m.reselected;
  d["cpu_update_launched"] = m.cpu_update_launched;
  d["written_back"] = m.written_back;
  d["cpu_update_disk_read_bytes"] = m.cpu_update_disk_read_bytes;
  d["cpu_update_disk_written_bytes"] = m.cpu_update_disk_written_bytes;
  d["cpu_update_disk_wait_seconds"] = m.cpu_update_disk_wait_seconds;
  return d;
}

void* to_stream(std::uintptr_t stream) {
  return reinterpret_cast<void*>(stream);
}

/// How one registered parameter is viewed.
struct layout {
  bool is_vector = false;
  int column_dim = 1;
  zenflow::index_t rows = 0;
  zenflow::index_t cols = 0;
  at::ScalarType type = at::kFloat;
  at::Device device = at::kCPU;
};

/// The 2-D view of a contiguous tensor under `column_dim` (see the file comment).
template <class View, class Ptr>
View matrix_of(Ptr data, const layout& l, zenflow::dtype type, zenflow::memory_space space) {
  return l.column_dim == 1 ? View::row_major(data, l.rows, l.cols, type, space)
                           : View::column_contiguous(data, l.rows, l.cols, type, space);
}

class coordinator {
 public:
  /// `group` (a torch.distributed ProcessGroup, with its `store`) makes this coordinator one rank
  /// of a data-parallel group; None: one process.
  coordinator(const py::dict& options, const py::dict& config, const std::string& device, const py::object& group,
              const py::object& store, double timeout_seconds, const py::object& nccl_id) {
    const auto o = to_options(options);
    const auto c = to_config(config);
    if (!group.is_none()) {
      zenflow::expects(device == "cpu" || device == "cuda", "device", "must be cpu or cuda, got ", device);
      zenflow::expects(timeout_seconds > 0, "timeout", "must be > 0 seconds, got ", timeout_seconds);
      // Python holds these objects through intrusive pointers: take another reference to each.
      auto pg = c10::intrusive_ptr<c10d::ProcessGroup>::reclaim_copy(&group.cast<c10d::ProcessGroup&>());
      const auto timeout = std::chrono::milliseconds(static_cast<std::int64_t>(timeout_seconds * 1000.0));
      if (device == "cuda") {
        // CUDA tensors: NCCL between the GPUs, on the trainer's streams; the group only carried
        // rank 0's unique id here.
        zenflow::expects(!nccl_id.is_none(), "nccl_id",
                         "CUDA tensors with a process group need the NCCL unique id (nccl_unique_id() on the first "
                         "rank, broadcast over the group)");
        const std::string id = nccl_id.cast<std::string>();
        const auto bytes = std::as_bytes(std::span<const char>(id.data(), id.size()));
        // NCCL cannot tell a peer why a rank failed: the group's Store carries it, under a key
        // made from the id (the same on every rank, another for each communicator).
        const py::object group_store =
            store.is_none()
                ? py::module_::import("torch.distributed.distributed_c10d").attr("_get_process_group_store")(group)
                : store;
        std::uint64_t h = zenflow::detail::fingerprint_basis;
        for (char x : id) h = zenflow::detail::fingerprint(h, x);
        auto channel = std::make_shared<store_abort_channel>(
            c10::intrusive_ptr<c10d::Store>::reclaim_copy(&group_store.cast<c10d::Store&>()),
            "zenflow/nccl_abort/" + std::to_string(h), pg->getRank(), pg->getSize());
        py::gil_scoped_release release;  // collective: every rank joins the NCCL communicator
        handle_ =
            make_cuda_data_parallel_handle(o, c, bytes, pg->getRank(), pg->getSize(), timeout, std::move(channel));
      } else {
        zenflow::expects(!store.is_none(), "store", "must be the process group's Store");
        auto st = c10::intrusive_ptr<c10d::Store>::reclaim_copy(&store.cast<c10d::Store&>());
        std::unique_ptr<process_group_communicator> communicator;
        {
          py::gil_scoped_release release;  // collective over the group (a broadcast)
          communicator = std::make_unique<process_group_communicator>(std::move(pg), std::move(st), timeout);
        }
        using dp = zenflow::data_parallel_host_coordinator<process_group_communicator>;
        handle_ = std::make_unique<coordinator_handle<dp, process_group_communicator>>(std::move(communicator), o, c);
      }
    } else if (device == "cpu") {
      handle_ = std::make_unique<coordinator_handle<zenflow::host_coordinator>>(o, c);
    } else if (device == "cuda") {
      handle_ = make_cuda_handle(o, c);
    } else {
      throw zenflow::error("device", "must be cpu or cuda, got " + device);
    }
    device_ = device;
  }

  std::string backend() const { return h().backend(); }

  std::size_t add_matrix(const std::string& name, const at::Tensor& param, int column_dim, const py::dict& adam) {
    zenflow::expects(param.dim() >= 2 && param.is_contiguous() && param.numel() > 0, "param",
                     "must be a non-empty contiguous tensor with at least 2 dimensions");
    zenflow::expects(column_dim == 0 || column_dim == 1, "column_dim", "must be 0 or 1, got ", column_dim);
    check_device(param, "param");
    layout l;
    l.column_dim = column_dim;
    const auto first = param.size(0), rest = param.numel() / param.size(0);
    l.rows = column_dim == 1 ? first : rest;
    l.cols = column_dim == 1 ? rest : first;
    l.type = param.scalar_type();
    l.device = param.device();
    const auto type = to_dtype(param, "param");
    const at::Tensor initial = param.detach().to(at::kCPU, at::kFloat).contiguous();
    const auto a = to_adam(adam);
    std::size_t index;
    {
      py::gil_scoped_release release;
      index = h().add_matrix(name, matrix_of<zenflow::matrix_view>(param.data_ptr(), l, type, to_space(param)),
                             matrix_of<zenflow::const_matrix_view>(static_cast<const void*>(initial.data_ptr()), l,
                                                                   zenflow::dtype::f32, zenflow::memory_space::host),
                             type, a);
    }
    layouts_.push_back(l);
    return index;
  }

  std::size_t add_vector(const std::string& name, const at::Tensor& param, const py::dict& adam) {
    zenflow::expects(param.is_contiguous() && param.numel() > 0, "param", "must be a non-empty contiguous tensor");
    check_device(param, "param");
    layout l;
    l.is_vector = true;
    l.rows = param.numel();
    l.type = param.scalar_type();
    l.device = param.device();
    const auto type = to_dtype(param, "param");
    const at::Tensor initial = param.detach().to(at::kCPU, at::kFloat).contiguous();
    const auto a = to_adam(adam);
    std::size_t index;
    {
      py::gil_scoped_release release;
      index = h().add_vector(name, zenflow::vector_view(param.data_ptr(), l.rows, type, to_space(param)),
                             std::span<const float>(initial.data_ptr<float>(), static_cast<std::size_t>(l.rows)), a);
    }
    layouts_.push_back(l);
    return index;
  }

  void submit(std::size_t i, const at::Tensor& grad, std::uintptr_t stream) {
    zenflow::expects(i < layouts_.size(), "parameter", "index ", i, " out of range");
    const layout& l = layouts_[i];
    zenflow::expects(grad.layout() == at::kStrided, "grad", "must be dense (sparse gradients are not supported)");
    zenflow::expects(grad.is_contiguous(), "grad", "must be contiguous");
    zenflow::expects(grad.device() == l.device, "grad", "is on ", grad.device().str(), ", its parameter on ",
                     l.device.str());
    zenflow::expects(grad.numel() == l.rows * (l.is_vector ? 1 : l.cols), "grad", "has ", grad.numel(),
                     " elements, its parameter ", l.rows * (l.is_vector ? 1 : l.cols));
    const auto type = to_dtype(grad, "grad");
    py::gil_scoped_release release;
    if (l.is_vector) {
      h().submit(i, zenflow::const_vector_view(grad.data_ptr(), l.rows, type, to_space(grad)), to_stream(stream));
    } else {
      h().submit(
          i, matrix_of<zenflow::const_matrix_view>(static_cast<const void*>(grad.data_ptr()), l, type, to_space(grad)),
          to_stream(stream));
    }
  }

  py::dict step(std::uintptr_t stream) {
    zenflow::step_metrics m;
    {
      py::gil_scoped_release release;
      m = h().step(to_stream(stream));
    }
    return to_dict(m);
  }
  void finish(std::uintptr_t stream) {
    py::gil_scoped_release release;
    h().finish(to_stream(stream));
  }
  void discard_gradients(std::uintptr_t stream) {
    py::gil_scoped_release release;
    h().discard_gradients(to_stream(stream));
  }
  void reload_parameter(std::size_t i, std::uintptr_t stream) {
    zenflow::expects(i < layouts_.size(), "parameter", "index ", i, " out of range");
    py::gil_scoped_release release;
    h().reload_parameter(i, to_stream(stream));
  }
  /// `contents`: "everything" (the parameters' values too) or "optimizer_state" (torch.optim's
  /// contract: the trainer restores its parameters itself).
  void save(const std::string& path, std::uintptr_t stream, const std::string& contents) {
    zenflow::expects(contents == "everything" || contents == "optimizer_state", "contents",
                     "must be everything or optimizer_state, got ", contents);
    const auto c = contents == "everything" ? zenflow::checkpoint_contents::everything
                                            : zenflow::checkpoint_contents::optimizer_state;
    py::gil_scoped_release release;
    h().save(path, c, to_stream(stream));
  }
  /// `match`: "names" (the parameters' names must agree) or "positions" (torch.optim's pairing).
  void load(const std::string& path, std::uintptr_t stream, const std::string& match) {
    zenflow::expects(match == "names" || match == "positions", "match", "must be names or positions, got ", match);
    const auto m = match == "names" ? zenflow::checkpoint_match::names : zenflow::checkpoint_match::positions;
    py::gil_scoped_release release;
    h().load(path, to_stream(stream), m);
  }
  void set_adam_options(std::size_t i, const py::dict& adam) {
    zenflow::expects(i < layouts_.size(), "parameter", "index ", i, " out of range");
    h().set_hyper_parameters(i, to_adam(adam));
  }
  py::dict metrics() const { return to_dict(h().metrics()); }
  /// None before the first step, else {"skipped", "grad_norm"} of the last step (waits for its
  /// statistics on the device).
  py::object last_step_gradients() const {
    std::optional<zenflow::step_gradients> g;
    {
      py::gil_scoped_release release;
      g = h().last_step_gradients();
    }
    if (!g) return py::none();
    py::dict d;
    d["skipped"] = g->skipped;
    d["grad_norm"] = g->grad_norm;
    return d;
  }
  py::list trace() const {
    py::list out;
    for (const auto& r : h().trace()) {
      py::dict d;
      d["interval"] = r.interval;
      d["first_step"] = r.first_step;
      d["last_step"] = r.last_step;
      d["accumulated_steps"] = r.accumulated_steps;
      d["written_back_at"] = r.written_back_at;
      d["write_backs"] = r.write_backs;
      d["synchronous"] = r.synchronous;
      out.append(d);
    }
    return out;
  }
  std::vector<std::int32_t> gpu_columns(std::size_t i) const { return h().gpu_columns(i); }
  std::int64_t step_count() const { return h().step_count(); }
  int rank() const { return h().rank(); }
  int ranks() const { return h().ranks(); }
  std::string nvme_status() const { return h().nvme_status(); }
  py::dict host_memory() const {
    zenflow::host_memory_bytes m;
    {
      py::gil_scoped_release release;  // waits for the CPU updates launched so far
      m = h().host_memory();
    }
    return to_dict(m);
  }
  std::pair<std::int64_t, std::int64_t> owned_columns(std::size_t i) const {
    zenflow::expects(i < layouts_.size(), "parameter", "index ", i, " out of range");
    return h().owned_columns(i);
  }
  /// Stops the workers (pending CPU results are not written back: call finish first).
  void close() {
    py::gil_scoped_release release;
    handle_.reset();
  }
  /// Data parallel: aborts this rank's group with `reason` (the peers fail at once with it), then
  /// closes without finishing: what a rank exiting after an error does (no collective, no wait for
  /// a peer that may be gone). One process: close(). Idempotent.
  void abort(const std::string& reason) {
    py::gil_scoped_release release;
    if (handle_ != nullptr) handle_->abort(reason);
    handle_.reset();
  }
  bool closed() const { return handle_ == nullptr; }

 private:
  handle& h() const {
    zenflow::expects(handle_ != nullptr, "optimizer", "is closed");
    return *handle_;
  }
  void check_device(const at::Tensor& t, const char* argument) const {
    zenflow::expects(t.is_cuda() == (device_ == "cuda") && (t.is_cuda() || t.is_cpu()), argument, "is on ",
                     t.device().str(), ", this coordinator serves ", device_, " tensors");
  }

  std::string device_;
  std::unique_ptr<handle> handle_;
  std::vector<layout> layouts_;
};

}  // namespace
}  // namespace zenflow_torch

PYBIND11_MODULE(_C, m) {
  using zenflow_torch::coordinator;
  m.doc() = "zenflow.torch's extension: the zenflow coordinator for torch tensors";
  py::register_exception<zenflow::error>(m, "ZenFlowError", PyExc_ValueError);
  m.attr("with_cuda") = zenflow_torch::with_cuda;
  m.attr("cuda_reason") = std::string(ZENFLOW_TORCH_CUDA_REASON);
  m.attr("with_nccl") = zenflow_torch::with_nccl;
  m.attr("nccl_reason") = std::string(zenflow_torch::with_nccl_reason());
  m.attr("version") = std::to_string(ZENFLOW_VERSION_MAJOR) + "." + std::to_string(ZENFLOW_VERSION_MINOR) + "." +
                      std::to_string(ZENFLOW_VERSION_PATCH);
  m.def(
      "nccl_unique_id",
      [] {
        const auto id = zenflow_torch::make_nccl_unique_id();
        return py::bytes(reinterpret_cast<const char*>(id.data()), id.size());
      },
      "A new NCCL unique id (bytes), for the first rank to broadcast to the others");
  m.def(
      "check_state_directory",
      [](const std::string& directory) { zenflow::detail::check_state_directory(directory, false); },
      py::arg("directory"),
      "Checks a directory for the NVMe state tier as the state file will (it exists, is a directory, is not "
      "tmpfs or ramfs); raises ZenFlowError saying what is wrong");
  m.def(
      "validate_options", [](const py::dict& options) { (void)zenflow_torch::to_options(options); }, py::arg("options"),
      "Checks the method's options as the coordinator will (zenflow_options::validate, adam_options::validate); "
      "raises ZenFlowError naming the first bad field");
  py::class_<coordinator>(m, "Coordinator")
      .def(py::init<const py::dict&, const py::dict&, const std::string&, const py::object&, const py::object&, double,
                    const py::object&>(),
           py::arg("options"), py::arg("config"), py::arg("device"), py::arg("group") = py::none(),
           py::arg("store") = py::none(), py::arg("timeout") = 600.0, py::arg("nccl_id") = py::none())
      .def("backend", &coordinator::backend)
      .def("add_matrix", &coordinator::add_matrix, py::arg("name"), py::arg("param"), py::arg("column_dim"),
           py::arg("adam"))
      .def("add_vector", &coordinator::add_vector, py::arg("name"), py::arg("param"), py::arg("adam"))
      .def("submit", &coordinator::submit, py::arg("index"), py::arg("grad"), py::arg("stream"))
      .def("step", &coordinator::step, py::arg("stream"))
      .def("finish", &coordinator::finish, py::arg("stream"))
      .def("discard_gradients", &coordinator::discard_gradients, py::arg("stream"))
      .def("reload_parameter", &coordinator::reload_parameter, py::arg("index"), py::arg("stream"))
      .def("save", &coordinator::save, py::arg("path"), py::arg("stream"), py::arg("contents") = "everything")
      .def("load", &coordinator::load, py::arg("path"), py::arg("stream"), py::arg("match") = "names")
      .def("set_adam_options", &coordinator::set_adam_options, py::arg("index"), py::arg("adam"))
      .def("metrics", &coordinator::metrics)
      .def("last_step_gradients", &coordinator::last_step_gradients)
      .def("trace", &coordinator::trace)
      .def("gpu_columns", &coordinator::gpu_columns, py::arg("index"))
      .def("step_count", &coordinator::step_count)
      .def("rank", &coordinator::rank)
      .def("ranks", &coordinator::ranks)
      .def("owned_columns", &coordinator::owned_columns, py::arg("index"))
      .def("nvme_status", &coordinator::nvme_status)
      .def("host_memory", &coordinator::host_memory)
      .def("close", &coordinator::close)
      .def("abort", &coordinator::abort, py::arg("reason"))
      .def("closed", &coordinator::closed);
}
