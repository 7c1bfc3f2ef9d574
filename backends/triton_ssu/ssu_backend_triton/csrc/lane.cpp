// A lane of the triton step compiled to one call: the layout guard of the call's tensors, their
// addresses, the output's allocation and the kernel's launch (ssu_backend_triton.compiled_lanes).
//
// A Lane is made once per bound layout with everything a launch of that layout passes: the CUDA
// function, grid, block and shared memory, the kernel's parameters packed as the CUDA driver
// reads them (one 8-byte slot each, the value in its low bytes), and which slots take the address
// of which argument of a call. A call (target, x, dt, A, B, C, D, z, dt_bias, softplus) -- or,
// for a lane bound to its target, the same without target -- returns the output it launched
// into, or None where the call is not one the lane was made for (another layout, another current
// device, an address not 16-byte aligned, softplus or the optional inputs given otherwise): the
// caller then launches as usual. The launch goes through the function whose address the lane
// was given, with cuLaunchKernelEx's signature (the driver's own, or a stand-in in tests).

#include <Python.h>
#include <structmember.h>

#include <ATen/ops/empty_like.h>
#include <c10/core/impl/DeviceGuardImplInterface.h>
#include <torch/csrc/autograd/python_variable.h>

#include <cstdint>
#include <cstring>
#include <vector>

#include "cuda.h"

namespace {

using LaunchEx = CUresult (*)(const CUlaunchConfig*, CUfunction, void**, void**);
using ErrorString = CUresult (*)(CUresult, const char**);

constexpr int kInputs = 9;  // target, x, dt, A, B, C, D, z, dt_bias
constexpr int kPointers = kInputs + 1;  // and the output

// What one input of a call must be: absent, or a tensor of this exact layout.
struct Layout {
  bool given = false;
  c10::ScalarType dtype = c10::ScalarType::Undefined;
  c10::Device device = c10::Device(c10::DeviceType::CPU);
  std::vector<int64_t> sizes;
  std::vector<int64_t> strides;
  bool requires_grad = false;
  c10::DispatchKeySet keys;

  // The dispatch keys first: a sparse or nested tensor differs there, before its strides are asked.
  bool matches(const at::Tensor& t) const {
    return t.defined() && t.key_set() == keys && t.scalar_type() == dtype && t.device() == device &&
           t.sizes().equals(sizes) && t.strides().equals(strides) && t.requires_grad() == requires_grad;
  }
};

struct State {
  LaunchEx launch = nullptr;
  ErrorString error_string = nullptr;
  CUfunction function = nullptr;
  unsigned grid[3] = {1, 1, 1};
  unsigned threads = 32;
  unsigned shared = 0;
  bool pdl = false;
  bool cooperative = false;
  const c10::impl::DeviceGuardImplInterface* cuda = nullptr;  // set for a lane of a CUDA device
  c10::Device device = c10::Device(c10::DeviceType::CPU);
  bool softplus = false;
  Layout layouts[kInputs];
  std::vector<int> slots[kPointers];  // parameter slots taking each pointer's address
  std::vector<uint64_t> values;       // the parameters, one 8-byte slot each
  std::vector<void*> params;          // &values[i]
  PyObject* target = nullptr;         // the bound target tensor, or null
  PyObject* holds = nullptr;          // what the lane keeps alive (the addresses packed in values)
};

struct LaneObject {
  PyObject_HEAD
  vectorcallfunc vectorcall;
  PyObject* dict;
  State* state;
};

PyObject* decline() { Py_RETURN_NONE; }

PyObject* lane_call(PyObject* self, PyObject* const* args, size_t nargsf, PyObject* kwnames) {
  State& s = *reinterpret_cast<LaneObject*>(self)->state;
  const Py_ssize_t nargs = PyVectorcall_NARGS(nargsf);
  const Py_ssize_t expected = s.target != nullptr ? kInputs : kInputs + 1;
  if (nargs != expected || (kwnames != nullptr && PyTuple_GET_SIZE(kwnames) != 0)) {
    PyErr_Format(PyExc_TypeError, "a lane takes %zd positional arguments (%zd given)", expected, nargs);
    return nullptr;
  }
  PyObject* inputs[kInputs];
  if (s.target != nullptr) {
    inputs[0] = s.target;
    std::memcpy(inputs + 1, args, sizeof(PyObject*) * (kInputs - 1));
  } else {
    std::memcpy(inputs, args, sizeof(PyObject*) * kInputs);
  }
  const int softplus = PyObject_IsTrue(args[nargs - 1]);
  if (softplus < 0) return nullptr;
  if (static_cast<bool>(softplus) != s.softplus) return decline();
  try {
    const at::Tensor* tensors[kInputs];
    for (int i = 0; i < kInputs; ++i) {
      PyObject* obj = inputs[i];
      const Layout& layout = s.layouts[i];
      if (!layout.given) {
        if (obj != Py_None) return decline();
        tensors[i] = nullptr;
        continue;
      }
      if (obj == Py_None || !THPVariable_Check(obj)) return decline();
      const at::Tensor& t = THPVariable_Unpack(obj);
      if (!layout.matches(t)) return decline();
      tensors[i] = &t;
    }
    if (s.cuda != nullptr && s.cuda->getDevice() != s.device) return decline();
    uint64_t addresses[kPointers];
    uint64_t unaligned = 0;
    for (int i = 0; i < kInputs; ++i) {
      addresses[i] = tensors[i] == nullptr ? 0 : reinterpret_cast<uint64_t>(tensors[i]->data_ptr());
      unaligned |= addresses[i];
    }
    if (unaligned & 15) return decline();
    at::Tensor out = at::empty_like(*tensors[1]);
    addresses[kInputs] = reinterpret_cast<uint64_t>(out.data_ptr());
    if (addresses[kInputs] & 15) return decline();
    for (int i = 0; i < kPointers; ++i) {
      for (int slot : s.slots[i]) s.values[slot] = addresses[i];
    }
    CUlaunchConfig config;
    CUlaunchAttribute attributes[2];
    config.gridDimX = s.grid[0];
    config.gridDimY = s.grid[1];
    config.gridDimZ = s.grid[2];
    config.blockDimX = s.threads;
    config.blockDimY = 1;
    config.blockDimZ = 1;
    config.sharedMemBytes = s.shared;
    config.hStream =
        s.cuda != nullptr ? static_cast<CUstream>(s.cuda->getStream(s.device).native_handle()) : nullptr;
    config.attrs = attributes;
    config.numAttrs = 0;
    if (s.pdl) {
      std::memset(&attributes[config.numAttrs], 0, sizeof(CUlaunchAttribute));
      attributes[config.numAttrs].id = CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION;
      attributes[config.numAttrs].value.programmaticStreamSerializationAllowed = 1;
      ++config.numAttrs;
    }
    if (s.cooperative) {
      std::memset(&attributes[config.numAttrs], 0, sizeof(CUlaunchAttribute));
      attributes[config.numAttrs].id = CU_LAUNCH_ATTRIBUTE_COOPERATIVE;
      attributes[config.numAttrs].value.cooperative = 1;
      ++config.numAttrs;
    }
    const CUresult result = s.launch(&config, s.function, s.params.data(), nullptr);
    if (result != CUDA_SUCCESS) {
      const char* text = nullptr;
      if (s.error_string == nullptr || s.error_string(result, &text) != CUDA_SUCCESS || text == nullptr) {
        text = "no description";
      }
      PyErr_Format(PyExc_RuntimeError,
                   "the triton step's launch failed: CUDA error %d (%s); CUDA_LAUNCH_BLOCKING=1 shows which call "
                   "failed, and compiled_lanes = false in [ssu.backends.triton] launches it through Triton instead",
                   static_cast<int>(result), text);
      return nullptr;
    }
    return THPVariable_Wrap(std::move(out));
  } catch (const std::exception& e) {
    PyErr_SetString(PyExc_RuntimeError, e.what());
    return nullptr;
  }
}

void lane_dealloc(PyObject* self) {
  auto* lane = reinterpret_cast<LaneObject*>(self);
  if (lane->state != nullptr) {
    Py_XDECREF(lane->state->target);
    Py_XDECREF(lane->state->holds);
    delete lane->state;
  }
  Py_XDECREF(lane->dict);
  PyTypeObject* type = Py_TYPE(self);
  type->tp_free(self);
  Py_DECREF(type);
}

PyMemberDef lane_members[] = {
    {"__vectorcalloffset__", T_PYSSIZET, offsetof(LaneObject, vectorcall), READONLY, nullptr},
    {"__dictoffset__", T_PYSSIZET, offsetof(LaneObject, dict), READONLY, nullptr},
    {nullptr, 0, 0, 0, nullptr},
};

PyType_Slot lane_slots[] = {
    {Py_tp_dealloc, reinterpret_cast<void*>(lane_dealloc)},
    {Py_tp_call, reinterpret_cast<void*>(PyVectorcall_Call)},
    {Py_tp_members, lane_members},
    {Py_tp_doc, const_cast<char*>("A lane of the triton step compiled to one call (made by make_lane).")},
    {0, nullptr},
};

PyType_Spec lane_spec = {
    "ssu_triton_lane.Lane",
    sizeof(LaneObject),
    0,
    Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_VECTORCALL,
    lane_slots,
};

PyObject* lane_type = nullptr;

bool read_layout(PyObject* obj, Layout& layout) {
  if (obj == Py_None) {
    layout.given = false;
    return true;
  }
  if (!THPVariable_Check(obj)) {
    PyErr_SetString(PyExc_TypeError, "a lane's reference inputs are tensors or None");
    return false;
  }
  const at::Tensor& t = THPVariable_Unpack(obj);
  layout.given = true;
  layout.dtype = t.scalar_type();
  layout.device = t.device();
  layout.sizes = t.sizes().vec();
  layout.strides = t.strides().vec();
  layout.requires_grad = t.requires_grad();
  layout.keys = t.key_set();
  return true;
}

// make_lane(launch, error_string, function, grid, threads, shared, pdl, cooperative, values, slots,
//           references, softplus, target, holds): see compiled_lanes.make.
PyObject* make_lane(PyObject*, PyObject* args) {
  unsigned long long launch, error_string, function;
  unsigned gx, gy, gz, threads, shared;
  int pdl, cooperative, softplus;
  PyObject *values, *slots, *references, *target, *holds;
  if (!PyArg_ParseTuple(args, "KKK(III)IIppOOOpOO", &launch, &error_string, &function, &gx, &gy, &gz, &threads,
                        &shared, &pdl, &cooperative, &values, &slots, &references, &softplus, &target, &holds)) {
    return nullptr;
  }
  if (launch == 0) {
    PyErr_SetString(PyExc_ValueError, "a lane needs the address of a launch function");
    return nullptr;
  }
  Py_buffer buffer;
  if (PyObject_GetBuffer(values, &buffer, PyBUF_SIMPLE) != 0) return nullptr;
  if (buffer.len % 8 != 0) {
    PyBuffer_Release(&buffer);
    PyErr_SetString(PyExc_ValueError, "a lane's packed parameters are 8 bytes each");
    return nullptr;
  }
  auto state = std::make_unique<State>();
  state->values.resize(buffer.len / 8);
  std::memcpy(state->values.data(), buffer.buf, buffer.len);
  PyBuffer_Release(&buffer);
  for (auto& value : state->values) state->params.push_back(&value);
  state->launch = reinterpret_cast<LaunchEx>(launch);
  state->error_string = reinterpret_cast<ErrorString>(error_string);
  state->function = reinterpret_cast<CUfunction>(function);
  state->grid[0] = gx;
  state->grid[1] = gy;
  state->grid[2] = gz;
  state->threads = threads;
  state->shared = shared;
  state->pdl = pdl;
  state->cooperative = cooperative;
  state->softplus = softplus;
  if (!PyTuple_Check(slots) || PyTuple_GET_SIZE(slots) != kPointers) {
    PyErr_Format(PyExc_ValueError, "a lane's slots are a tuple of %d tuples", kPointers);
    return nullptr;
  }
  for (int i = 0; i < kPointers; ++i) {
    PyObject* row = PyTuple_GET_ITEM(slots, i);
    if (!PyTuple_Check(row)) {
      PyErr_SetString(PyExc_ValueError, "a lane's slots are tuples of parameter indices");
      return nullptr;
    }
    for (Py_ssize_t j = 0; j < PyTuple_GET_SIZE(row); ++j) {
      const long slot = PyLong_AsLong(PyTuple_GET_ITEM(row, j));
      if (slot == -1 && PyErr_Occurred()) return nullptr;
      if (slot < 0 || static_cast<size_t>(slot) >= state->values.size()) {
        PyErr_Format(PyExc_ValueError, "parameter slot %ld is out of range", slot);
        return nullptr;
      }
      state->slots[i].push_back(static_cast<int>(slot));
    }
  }
  if (!PyTuple_Check(references) || PyTuple_GET_SIZE(references) != kInputs) {
    PyErr_Format(PyExc_ValueError, "a lane's references are a tuple of %d inputs", kInputs);
    return nullptr;
  }
  try {
    for (int i = 0; i < kInputs; ++i) {
      if (!read_layout(PyTuple_GET_ITEM(references, i), state->layouts[i])) return nullptr;
    }
    if (!state->layouts[0].given || !state->layouts[1].given) {
      PyErr_SetString(PyExc_ValueError, "a lane's target and x are tensors");
      return nullptr;
    }
    state->device = state->layouts[0].device;
    if (state->device.is_cuda()) {
      state->cuda = c10::impl::getDeviceGuardImpl(c10::DeviceType::CUDA);
      (void)state->cuda->getStream(state->device).native_handle();  // a torch without it fails here, not in a call
    }
  } catch (const std::exception& e) {
    PyErr_SetString(PyExc_RuntimeError, e.what());
    return nullptr;
  }
  auto* lane = PyObject_New(LaneObject, reinterpret_cast<PyTypeObject*>(lane_type));
  if (lane == nullptr) return nullptr;
  lane->vectorcall = lane_call;
  lane->dict = nullptr;
  if (target != Py_None) {
    Py_INCREF(target);
    state->target = target;
  }
  Py_INCREF(holds);
  state->holds = holds;
  lane->state = state.release();
  return reinterpret_cast<PyObject*>(lane);
}

PyMethodDef methods[] = {
    {"make_lane", make_lane, METH_VARARGS, "A compiled lane (see compiled_lanes.make)."},
    {nullptr, nullptr, 0, nullptr},
};

PyModuleDef module_def = {PyModuleDef_HEAD_INIT, "ssu_triton_lane", nullptr, -1, methods};

}  // namespace

PyMODINIT_FUNC PyInit_ssu_triton_lane(void) {
  lane_type = PyType_FromSpec(&lane_spec);
  if (lane_type == nullptr) return nullptr;
  PyObject* module = PyModule_Create(&module_def);
  if (module == nullptr) return nullptr;
  Py_INCREF(lane_type);
  if (PyModule_AddObject(module, "Lane", lane_type) != 0) {
    Py_DECREF(lane_type);
    Py_DECREF(module);
    return nullptr;
  }
  return module;
}
