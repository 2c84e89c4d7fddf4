/* The block-key chain loop in C: key[i] = xxh3_128(key[i-1] || block i).
 *
 * Same bytes as prefixpool/store/keys.py's pure-Python loop (tests compare them); this
 * only removes the interpreter from the per-block path. Knows nothing else.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <string.h>
#define XXH_INLINE_ALL
#include <xxhash.h>

#define KEY_BYTES 16

static PyObject *chain_from(PyObject *self, PyObject *args) {
    Py_buffer parent, packed;
    Py_ssize_t block_size;
    if (!PyArg_ParseTuple(args, "y*y*n", &parent, &packed, &block_size)) return NULL;
    PyObject *keys = NULL;
    unsigned char *scratch = NULL;
    if (parent.len != KEY_BYTES) {
        /* the namespace root is itself a 16-byte digest (an empty parent would be read past its end) */
        PyErr_SetString(PyExc_ValueError, "parent must be 16 bytes");
        goto done;
    }
    if (block_size <= 0) {
        PyErr_SetString(PyExc_ValueError, "block_size must be positive");
        goto done;
    }
    Py_ssize_t step = block_size * 4;
    Py_ssize_t count = packed.len / step;
    keys = PyList_New(count);
    scratch = PyMem_Malloc(KEY_BYTES + step);
    if (keys == NULL || scratch == NULL) { Py_CLEAR(keys); PyErr_NoMemory(); goto done; }
    memcpy(scratch, parent.buf, KEY_BYTES);
    const unsigned char *data = packed.buf;
    for (Py_ssize_t i = 0; i < count; i++) {
        memcpy(scratch + KEY_BYTES, data + i * step, step);
        XXH128_canonical_t out;
        XXH128_canonicalFromHash(&out, XXH3_128bits(scratch, KEY_BYTES + step));
        memcpy(scratch, out.digest, KEY_BYTES);
        PyObject *key = PyBytes_FromStringAndSize((const char *)out.digest, KEY_BYTES);
        if (key == NULL) { Py_CLEAR(keys); goto done; }
        PyList_SET_ITEM(keys, i, key);
    }
done:
    PyMem_Free(scratch);
    PyBuffer_Release(&parent);
    PyBuffer_Release(&packed);
    return keys;
}

static PyMethodDef methods[] = {
    {"chain_from", chain_from, METH_VARARGS, "chain_from(parent, packed, block_size) -> list[bytes]"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "store._chain", NULL, -1, methods};

PyMODINIT_FUNC PyInit__chain(void) { return PyModule_Create(&module); }
