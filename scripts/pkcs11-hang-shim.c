/*
 * A PKCS#11 module for signerd's end-to-end tests: a seam in front of a real
 * module's function table, in another process than the test (the daemon).
 * Every call goes to the module SIGNERD_SHIM_MODULE names (SoftHSM by
 * default), except that C_Sign first appends one line to the file
 * SIGNERD_SHIM_LOG (when set), then waits while the file SIGNERD_SHIM_HANG
 * exists: a signing call that hangs for as long as the test wants.
 *
 * The end-to-end tests build it (Tests/EndToEndTests/HungModuleTests.swift):
 *
 *   cc -shared -fPIC scripts/pkcs11-hang-shim.c -o /tmp/pkcs11-hang-shim.so -ldl
 *
 * and point token_uri's module-path at it. Not for production use.
 */
#include <dlfcn.h>
#include <fcntl.h>
#include <p11-kit-1/p11-kit/pkcs11.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

static CK_FUNCTION_LIST *real_functions;
static CK_FUNCTION_LIST shim_functions;

static CK_RV shim_sign(CK_SESSION_HANDLE session, CK_BYTE_PTR data, CK_ULONG data_length,
                       CK_BYTE_PTR signature, CK_ULONG_PTR signature_length) {
    const char *log = getenv("SIGNERD_SHIM_LOG");
    // A length query (no buffer) is not a signature: only real calls are logged and held.
    if (signature != NULL) {
        if (log != NULL) {
            int fd = open(log, O_WRONLY | O_APPEND | O_CREAT | O_CLOEXEC, 0600);
            if (fd >= 0) {
                ssize_t ignored = write(fd, "C_Sign\n", 7);
                (void)ignored;
                close(fd);
            }
        }
        const char *hang = getenv("SIGNERD_SHIM_HANG");
        while (hang != NULL && access(hang, F_OK) == 0) {
            usleep(10000);
        }
    }
    return real_functions->C_Sign(session, data, data_length, signature, signature_length);
}

CK_RV C_GetFunctionList(CK_FUNCTION_LIST_PTR_PTR list) {
    if (list == NULL) {
        return CKR_ARGUMENTS_BAD;
    }
    if (real_functions == NULL) {
        const char *path = getenv("SIGNERD_SHIM_MODULE");
        void *module = dlopen(path != NULL ? path : "/usr/lib/softhsm/libsofthsm2.so", RTLD_NOW | RTLD_LOCAL);
        if (module == NULL) {
            return CKR_GENERAL_ERROR;
        }
        CK_C_GetFunctionList get = (CK_C_GetFunctionList)dlsym(module, "C_GetFunctionList");
        if (get == NULL || get(&real_functions) != CKR_OK || real_functions == NULL) {
            return CKR_GENERAL_ERROR;
        }
        memcpy(&shim_functions, real_functions, sizeof(shim_functions));
        shim_functions.C_Sign = shim_sign;
    }
    *list = &shim_functions;
    return CKR_OK;
}
